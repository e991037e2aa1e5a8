//! `AsyncCopy` for Metal: copies are blits on the GPU's blit queue, each followed by a signal of
//! the engine's shared event to the copy's sequence number. `wait(token)` blocks on the event
//! value (then collects the finished copies' errors). `wait_on_device(token)` blocks nothing: it
//! records the (event, value) in the device's [`DeviceWaits`], and the device's next compute
//! submission encodes a wait for it (`encodeWaitForEvent`) before its work. Every copy also
//! fences the byte ranges it reads and writes on its buffers, so a host `read`/`write`/
//! `copy_from` of those bytes waits (on the host) for the copy first. A copy whose command
//! buffer fails never signals: every wait polls the copies' own status between timeouts, records
//! the failure (a `Device` error at the waits on its token) and raises the event from the host so
//! no host or device wait on it hangs. A copy between overlapping bytes of one buffer is refused
//! at issue (undefined for a Metal blit). Host sources are staged into a fresh shared buffer at
//! issue (the host bytes themselves are not GPU memory).
use crate::buffer::MetalBuffer;
use crate::gpu::{BlitCopy, Gpu, GpuBuffer, GpuEvent, Submitted};
use rlx_ir::{AsyncCopy, BarrierToken, Error, Result};
use rlx_runtime::backend::check_copy;
use rlx_runtime::{CopyDst, CopySrc, DeviceBuffer};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static ENGINES: AtomicU64 = AtomicU64::new(1);

/// How long a host wait blocks on the event before it looks at the copies' own status.
const WAIT_SLICE_MS: u64 = 50;

#[derive(Default)]
struct State {
    /// Sequence number of the last issued copy.
    issued: u64,
    /// Submitted copies not yet collected, in issue order.
    pending: VecDeque<(u64, Box<dyn Submitted>)>,
    /// Copies that failed, by sequence number (reported at every wait on them).
    failed: BTreeMap<u64, Error>,
}

/// The part of a copy engine that device-side waits and buffer fences keep alive.
pub(crate) struct Engine {
    gpu: Arc<dyn Gpu>,
    id: u64,
    event: Arc<dyn GpuEvent>,
    state: Mutex<State>,
}

impl Engine {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_token(&self, token: BarrierToken) -> Result<()> {
        let issued = self.lock().issued;
        if token.engine != self.id {
            return Err(Error::Input {
                name: "token".into(),
                msg: format!(
                    "barrier token of copy engine {} given to copy engine {}",
                    token.engine, self.id
                ),
            });
        }
        if token.seq == 0 || token.seq > issued {
            return Err(Error::Input {
                name: "token".into(),
                msg: format!(
                    "no copy {} was issued on this engine ({issued} so far)",
                    token.seq
                ),
            });
        }
        Ok(())
    }

    /// Whether the event says copy `seq` (and every earlier one) completed; never blocks.
    pub(crate) fn reached(&self, seq: u64) -> bool {
        self.event.signaled_value() >= seq
    }

    /// Never blocks: true once every copy up to `seq` completed or failed. The event is then
    /// raised to `seq` from the host if it is not there yet: a failed copy's signal never
    /// comes, and a host raise for an earlier failure can overwrite a later copy's signal that
    /// landed between its read and its write. Raising is always right once every copy up to
    /// `seq` is over, and it releases the host and device waits on it (a failure is reported
    /// at the waits on its token).
    pub(crate) fn progress(&self, seq: u64) -> bool {
        if self.reached(seq) {
            return true;
        }
        let mut over = true;
        for (s, sub) in self.lock().pending.iter() {
            if *s > seq {
                break;
            }
            if sub.poll().is_none() {
                over = false;
                break;
            }
        }
        if over && !self.reached(seq) {
            self.event.signal(seq);
        }
        over
    }

    /// Waits (on the host) for the event to reach `seq`, then collects the finished copies.
    /// Between timeouts it looks at the copies' submissions themselves: a failed copy ends the
    /// wait (and is recorded as failed) instead of leaving it for a signal that never comes.
    pub(crate) fn wait_seq(&self, seq: u64) {
        while !self.event.wait_until(seq, WAIT_SLICE_MS) {
            if self.progress(seq) {
                break;
            }
        }
        let done: Vec<(u64, Box<dyn Submitted>)> = {
            let mut st = self.lock();
            let mut done = Vec::new();
            while st.pending.front().is_some_and(|(s, _)| *s <= seq) {
                done.extend(st.pending.pop_front());
            }
            done
        };
        let errors: Vec<(u64, Error)> = done
            .into_iter()
            .filter_map(|(s, sub)| {
                sub.finish().err().map(|e| {
                    let e = Error::Device(format!(
                        "Metal: copy {s} of copy engine {} failed on the blit queue: {e}",
                        self.id
                    ));
                    (s, e)
                })
            })
            .collect();
        if !errors.is_empty() {
            self.lock().failed.extend(errors);
        }
    }

    /// The error of copy `seq`, if it failed (known once it was collected).
    fn failure(&self, seq: u64) -> Result<()> {
        match self.lock().failed.get(&seq) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

/// A wait `wait_on_device` recorded: the device's next compute submission waits, on the
/// device, for the engine's event to reach `seq`.
#[derive(Clone)]
pub(crate) struct DeviceWait {
    engine: Arc<Engine>,
    seq: u64,
}

/// The device-side waits recorded on one device and not yet taken by a compute submission.
#[derive(Default)]
pub struct DeviceWaits(Mutex<Vec<DeviceWait>>);

impl DeviceWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<DeviceWait>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn push(&self, w: DeviceWait) {
        self.lock().push(w);
    }
    /// Takes every recorded wait (for the submission being built).
    pub(crate) fn take(&self) -> Vec<DeviceWait> {
        std::mem::take(&mut *self.lock())
    }
    /// How many waits are recorded and not yet taken.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a submission taking `waits` waits for on the device: one wait per engine, its highest
/// value (an engine's copies complete in issue order).
pub(crate) fn wait_events(waits: &[DeviceWait]) -> Vec<DeviceWait> {
    let mut by_engine: BTreeMap<u64, DeviceWait> = BTreeMap::new();
    for w in waits {
        let e = by_engine.entry(w.engine.id).or_insert_with(|| w.clone());
        e.seq = e.seq.max(w.seq);
    }
    by_engine.into_values().collect()
}

impl DeviceWait {
    /// The event and value the device waits for.
    pub(crate) fn event(&self) -> (Arc<dyn GpuEvent>, u64) {
        (self.engine.event.clone(), self.seq)
    }
    /// See [`Engine::progress`]: called while a submission waits on the device for this.
    pub(crate) fn progress(&self) -> bool {
        self.engine.progress(self.seq)
    }
}

/// After the submission that waited for `waits` completed (or failed to be made): collects the
/// waited copies (at once where the device waited for them) and returns the first one's error —
/// where a copy waited for on the device reports its failure.
pub(crate) fn settle(waits: &[DeviceWait]) -> Result<()> {
    let mut first = Ok(());
    for w in waits {
        w.engine.wait_seq(w.seq);
        if first.is_ok() {
            first = w.engine.failure(w.seq);
        }
    }
    first
}

/// The copy engine of one Metal device.
pub struct MetalCopyEngine {
    inner: Arc<Engine>,
    waits: Arc<DeviceWaits>,
}

fn metal_buffer<'a>(b: &'a Arc<dyn DeviceBuffer>, what: &str) -> Result<&'a MetalBuffer> {
    b.as_any()
        .downcast_ref::<MetalBuffer>()
        .ok_or_else(|| Error::Unsupported {
            op: "copy".into(),
            msg: format!("the Metal copy engine cannot copy {what} a buffer of another backend"),
        })
}

impl MetalCopyEngine {
    /// An engine on `gpu`'s blit queue whose device-side waits go to `waits` (the device's).
    pub fn new(gpu: Arc<dyn Gpu>, waits: Arc<DeviceWaits>) -> Result<Self> {
        let event = gpu.new_event()?;
        Ok(Self {
            inner: Arc::new(Engine {
                gpu,
                id: ENGINES.fetch_add(1, Ordering::Relaxed),
                event,
                state: Mutex::new(State::default()),
            }),
            waits,
        })
    }

    /// The event and value a compute submission must wait for (on the device) before it reads
    /// what the copy named by `token` (and every earlier one) wrote.
    pub fn device_wait(&self, token: BarrierToken) -> Result<(Arc<dyn GpuEvent>, u64)> {
        self.inner.check_token(token)?;
        Ok((self.inner.event.clone(), token.seq))
    }
}

impl AsyncCopy for MetalCopyEngine {
    type Src = CopySrc;
    type Dst = CopyDst;

    fn issue(&self, src: CopySrc, dst: CopyDst, bytes: usize) -> Result<BarrierToken> {
        check_copy(&src, &dst, bytes)?;
        let dst_buf = metal_buffer(&dst.buffer, "into")?;
        let (src_gpu, src_offset, src_buf): (Arc<dyn GpuBuffer>, usize, Option<&MetalBuffer>) =
            match &src {
                CopySrc::Device { buffer, offset } => {
                    let b = metal_buffer(buffer, "from")?;
                    (b.gpu.clone(), *offset, Some(b))
                }
                CopySrc::Host(h) => {
                    let staging = MetalBuffer::new(self.inner.gpu.new_buffer(bytes)?);
                    staging.write(0, &h.bytes()[..bytes])?;
                    (staging.gpu, 0, None)
                }
            };
        let copy = BlitCopy {
            src: src_gpu,
            src_offset,
            dst: dst_buf.gpu.clone(),
            dst_offset: dst.offset,
            bytes,
        };
        if copy.overlaps() {
            return Err(Error::Unsupported {
                op: "copy".into(),
                msg: format!(
                    "the Metal copy engine cannot copy bytes {src_offset}..{} of a buffer onto \
                     its bytes {}..{} (a blit between overlapping ranges of one buffer is \
                     undefined); copy through a second buffer",
                    src_offset + bytes,
                    dst.offset,
                    dst.offset + bytes
                ),
            });
        }
        let mut st = self.inner.lock();
        let seq = st.issued + 1;
        let sub = self.inner.gpu.blit(copy, &self.inner.event, seq)?;
        st.issued = seq;
        st.pending.push_back((seq, sub));
        drop(st);
        // Host accesses of these bytes wait for the copy.
        dst_buf.fence(&self.inner, seq, dst.offset, bytes);
        if let Some(s) = src_buf {
            s.fence(&self.inner, seq, src_offset, bytes);
        }
        Ok(BarrierToken {
            engine: self.inner.id,
            seq,
        })
    }

    fn wait(&self, token: BarrierToken) -> Result<()> {
        self.inner.check_token(token)?;
        self.inner.wait_seq(token.seq);
        self.inner.failure(token.seq)
    }

    fn wait_on_device(&self, token: BarrierToken) -> Result<()> {
        self.inner.check_token(token)?;
        if self.inner.reached(token.seq) {
            // Already complete: nothing for the device to wait for; collect it here.
            self.inner.wait_seq(token.seq);
            return self.inner.failure(token.seq);
        }
        self.waits.push(DeviceWait {
            engine: self.inner.clone(),
            seq: token.seq,
        });
        Ok(())
    }

    fn wait_all(&self) -> Result<()> {
        let issued = self.inner.lock().issued;
        if issued > 0 {
            self.inner.wait_seq(issued);
        }
        match self.inner.lock().failed.values().next() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl Drop for MetalCopyEngine {
    fn drop(&mut self) {
        let _ = self.wait_all();
    }
}
