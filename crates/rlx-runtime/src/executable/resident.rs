//! Resident inputs: bound once into the arena, and grown in place by row writes (a KV cache).
use super::{check_feed, check_limit, find_slot, Executable};
use crate::backend::check_range;
use crate::{Error, Result};

impl Executable {
    /// Places `data` in the input slot `name` once; later runs may omit it.
    pub fn bind(&self, name: &str, data: &[u8]) -> Result<()> {
        let mut inner = self.lock();
        let slot = find_slot(&inner.inputs, name)?;
        check_feed(slot, data)?;
        if !slot.bound && inner.prefetch.as_ref().is_some_and(|p| !p.queue.is_empty()) {
            return Err(Error::input(
                name,
                "cannot bind an input while prefetched batches wait; run them first",
            ));
        }
        let _params = self.params.lock();
        self.arena.write(slot.at.offset, data)?;
        let slot = inner
            .inputs
            .iter_mut()
            .find(|s| s.name == name)
            .expect("found above");
        if !slot.bound {
            slot.bound = true;
            inner.prefetch = None; // the staging layout depends on which inputs are bound
        }
        Ok(())
    }

    /// Writes `count` rows along `axis` of the input `name`, starting at row `start`, in place.
    pub fn write_rows(&self, name: &str, axis: usize, start: usize, data: &[u8]) -> Result<()> {
        let inner = self.lock();
        let slot = find_slot(&inner.inputs, name)?;
        let dims = slot.at.shape.dims();
        if axis >= dims.len() {
            return Err(Error::shape(
                name,
                format!("axis {axis} is out of range for shape {}", slot.at.shape),
            ));
        }
        let outer: usize = dims[..axis].iter().product();
        let inner_len: usize = dims[axis + 1..].iter().product::<usize>() * slot.at.dtype.size();
        let row_block = inner_len * outer;
        if row_block == 0 || data.len() % row_block != 0 {
            return Err(Error::shape(
                name,
                format!(
                    "rows of {} bytes do not fit whole rows of shape {} along axis {axis}",
                    data.len(),
                    slot.at.shape
                ),
            ));
        }
        let count = data.len() / row_block;
        if start.checked_add(count).is_none_or(|end| end > dims[axis]) {
            return Err(Error::input(
                name,
                format!(
                    "writing {count} rows at {start} overflows axis {axis} of size {} (shape {})",
                    dims[axis], slot.at.shape
                ),
            ));
        }
        check_limit(slot, data)?;
        let _params = self.params.lock();
        let chunk = count * inner_len;
        for o in 0..outer {
            let dst = slot.at.offset + (o * dims[axis] + start) * inner_len;
            check_range(name, dst, chunk, self.arena.len())?;
            self.arena.write(dst, &data[o * chunk..(o + 1) * chunk])?;
        }
        Ok(())
    }
}
