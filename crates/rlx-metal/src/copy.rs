//! `AsyncCopy` for Metal: copies are blits on the GPU's blit queue, each followed by a signal of
//! the engine's shared event to the copy's sequence number. `wait(token)` blocks on the event
//! value (then collects the finished copies' errors); `device_wait` names the (event, value) a
//! compute submission waits for on the device instead. Host sources are staged into a fresh
//! shared buffer at issue (the host bytes themselves are not GPU memory).
use crate::buffer::MetalBuffer;
use crate::gpu::{BlitCopy, Gpu, GpuBuffer, GpuEvent, Submitted};
use rlx_ir::{AsyncCopy, BarrierToken, Error, Result};
use rlx_runtime::backend::check_copy;
use rlx_runtime::{CopyDst, CopySrc, DeviceBuffer};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static ENGINES: AtomicU64 = AtomicU64::new(1);

#[derive(Default)]
struct State {
    /// Sequence number of the last issued copy.
    issued: u64,
    /// Submitted copies not yet collected, in issue order.
    pending: VecDeque<(u64, Box<dyn Submitted>)>,
    /// Copies that failed, by sequence number (reported at every wait on them).
    failed: BTreeMap<u64, Error>,
}

/// The copy engine of one Metal device.
pub struct MetalCopyEngine {
    gpu: Arc<dyn Gpu>,
    id: u64,
    event: Arc<dyn GpuEvent>,
    state: Mutex<State>,
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
    pub fn new(gpu: Arc<dyn Gpu>) -> Result<Self> {
        let event = gpu.new_event()?;
        Ok(Self {
            gpu,
            id: ENGINES.fetch_add(1, Ordering::Relaxed),
            event,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_token(&self, token: BarrierToken, issued: u64) -> Result<()> {
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

    /// The event and value a compute submission must wait for (on the device) before it reads
    /// what the copy named by `token` (and every earlier one) wrote.
    pub fn device_wait(&self, token: BarrierToken) -> Result<(Arc<dyn GpuEvent>, u64)> {
        let issued = self.lock().issued;
        self.check_token(token, issued)?;
        Ok((self.event.clone(), token.seq))
    }

    /// Waits (on the host) for the event to reach `seq`, then collects the finished copies.
    fn wait_seq(&self, seq: u64) {
        while !self.event.wait_until(seq, 1000) {}
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
            .filter_map(|(s, sub)| sub.finish().err().map(|e| (s, e)))
            .collect();
        if !errors.is_empty() {
            self.lock().failed.extend(errors);
        }
    }
}

impl AsyncCopy for MetalCopyEngine {
    type Src = CopySrc;
    type Dst = CopyDst;

    fn issue(&self, src: CopySrc, dst: CopyDst, bytes: usize) -> Result<BarrierToken> {
        check_copy(&src, &dst, bytes)?;
        let dst_gpu = metal_buffer(&dst.buffer, "into")?.gpu.clone();
        let (src_gpu, src_offset): (Arc<dyn GpuBuffer>, usize) = match &src {
            CopySrc::Device { buffer, offset } => {
                (metal_buffer(buffer, "from")?.gpu.clone(), *offset)
            }
            CopySrc::Host(h) => {
                let staging = MetalBuffer::new(self.gpu.new_buffer(bytes)?);
                staging.write(0, &h.bytes()[..bytes])?;
                (staging.gpu, 0)
            }
        };
        let mut st = self.lock();
        let seq = st.issued + 1;
        let copy = BlitCopy {
            src: src_gpu,
            src_offset,
            dst: dst_gpu,
            dst_offset: dst.offset,
            bytes,
        };
        let sub = self.gpu.blit(copy, &self.event, seq)?;
        st.issued = seq;
        st.pending.push_back((seq, sub));
        Ok(BarrierToken {
            engine: self.id,
            seq,
        })
    }

    fn wait(&self, token: BarrierToken) -> Result<()> {
        let issued = self.lock().issued;
        self.check_token(token, issued)?;
        self.wait_seq(token.seq);
        match self.lock().failed.get(&token.seq) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn wait_all(&self) -> Result<()> {
        let issued = self.lock().issued;
        if issued > 0 {
            self.wait_seq(issued);
        }
        match self.lock().failed.values().next() {
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
