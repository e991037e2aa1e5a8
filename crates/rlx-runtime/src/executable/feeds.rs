//! Inputs: their pinned slots, and the checks every feed passes before anything is written.
use crate::{Error, Result, TRef};
use rlx_ir::{DType, Graph, Op};

/// A named input's pinned slot in the arena.
#[derive(Clone, Debug)]
pub struct InputSlot {
    pub name: String,
    pub at: TRef,
    /// Bound once as a resident input: later runs need not supply it.
    pub bound: bool,
    /// For integer class ids / token ids: every value must be in `0..limit`.
    pub limit: Option<(i64, &'static str)>,
}

pub(super) fn find_slot<'a>(slots: &'a [InputSlot], name: &str) -> Result<&'a InputSlot> {
    slots.iter().find(|s| s.name == name).ok_or_else(|| {
        let known: Vec<&str> = slots.iter().map(|s| s.name.as_str()).collect();
        Error::input(
            name,
            format!("unknown input; this function takes {known:?}"),
        )
    })
}

/// Checks every feed before anything runs: a known name given once, the exact byte size, ids in
/// range. With `bound_refusal` non-empty, feeding a bound (resident) input is an error saying so.
pub(super) fn check_feeds(
    slots: &[InputSlot],
    feeds: &[(&str, &[u8])],
    bound_refusal: &str,
) -> Result<()> {
    for (i, (name, data)) in feeds.iter().enumerate() {
        if feeds[..i].iter().any(|(n, _)| n == name) {
            return Err(Error::input(*name, "given twice"));
        }
        let slot = find_slot(slots, name)?;
        if slot.bound && !bound_refusal.is_empty() {
            return Err(Error::input(
                *name,
                format!("is a bound (resident) input; {bound_refusal}"),
            ));
        }
        check_feed(slot, data)?;
    }
    Ok(())
}

/// The first unbound input the feeds do not supply.
pub(super) fn missing_input<'a>(
    slots: &'a [InputSlot],
    feeds: &[(&str, &[u8])],
) -> Option<&'a InputSlot> {
    slots
        .iter()
        .find(|s| !s.bound && !feeds.iter().any(|(n, _)| *n == s.name))
}

pub(super) fn check_feed(slot: &InputSlot, data: &[u8]) -> Result<()> {
    if data.len() != slot.at.bytes() {
        return Err(Error::shape(
            &slot.name,
            format!(
                "expected {} {} ({} bytes), got {} bytes",
                slot.at.shape,
                slot.at.dtype,
                slot.at.bytes(),
                data.len()
            ),
        ));
    }
    check_limit(slot, data)
}

pub(super) fn check_limit(slot: &InputSlot, data: &[u8]) -> Result<()> {
    let Some((limit, what)) = slot.limit else {
        return Ok(());
    };
    let mut values: Box<dyn Iterator<Item = i64>> = if slot.at.dtype == DType::I64 {
        Box::new(
            data.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))),
        )
    } else {
        Box::new(
            data.chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64),
        )
    };
    let bad = values
        // Cross-entropy leaves rows labelled -100 out (PyTorch's default ignore_index).
        .find(|&v| (v < 0 || v >= limit) && !(what == "label" && v == -100));
    match bad {
        Some(v) => Err(Error::input(
            &slot.name,
            format!(
                "{what} {v} is out of range [0, {limit}){}",
                if what == "label" {
                    " (-100: an ignored row)"
                } else {
                    ""
                }
            ),
        )),
        None => Ok(()),
    }
}

/// If input `id` is used (directly or through reshapes, or an int64 input through its cast to
/// int32) as class labels or as embedding ids, the exclusive upper bound of its values, checked
/// before any run (so an int64 id never wraps into a valid int32 one).
pub(super) fn index_limit(graph: &Graph, id: usize) -> Option<(i64, &'static str)> {
    if !matches!(graph.node(id).dtype, DType::I32 | DType::I64) {
        return None;
    }
    let mut sources = vec![id];
    let mut limit: Option<(i64, &'static str)> = None;
    let mut tighten = |bound: usize, what: &'static str| {
        let bound = bound as i64;
        if limit.is_none_or(|(l, _)| bound < l) {
            limit = Some((bound, what));
        }
    };
    for (n, node) in graph.nodes().iter().enumerate().skip(id + 1) {
        match &node.op {
            Op::Reshape { .. }
            | Op::Cast {
                to: DType::I32 | DType::I64,
            } if sources.contains(&node.inputs[0]) => sources.push(n),
            Op::SoftmaxCrossEntropy if sources.contains(&node.inputs[1]) => {
                tighten(graph.node(node.inputs[0]).shape.dims()[1], "label")
            }
            Op::Gather if sources.contains(&node.inputs[1]) => {
                tighten(graph.node(node.inputs[0]).shape.dims()[0], "id")
            }
            _ => {}
        }
    }
    limit
}
