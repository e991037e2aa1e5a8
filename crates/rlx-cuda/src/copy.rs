//! The CUDA copy engine: copies on a stream of their own, each followed by an event; a token's
//! wait is that event's (the stream runs copies in issue order, so it covers every earlier one),
//! on the host or, for `wait_on_device`, by the compute stream itself (the host goes on).
use crate::driver::{Event, Stream};
use crate::mem::CudaBuffer;
use rlx_ir::{AsyncCopy, BarrierToken, Error, Result};
use rlx_runtime::backend::check_copy;
use rlx_runtime::{CopyDst, CopySrc};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1 << 32);

/// A copy in flight: its completion event and what must live until then.
struct Pending {
    event: Event,
    _src: CopySrc,
    _dst: CopyDst,
}

#[derive(Default)]
struct State {
    issued: u64,
    /// Copies not yet known to be complete, by sequence number.
    pending: BTreeMap<u64, Pending>,
    failed: BTreeMap<u64, Error>,
}

/// See [`rlx_ir::copy`] for the contract.
pub struct CudaCopyEngine {
    id: u64,
    stream: Stream,
    state: Mutex<State>,
}

impl CudaCopyEngine {
    pub fn new(stream: Stream) -> CudaCopyEngine {
        CudaCopyEngine {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            stream,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start(&self, src: &CopySrc, dst: &CopyDst, bytes: usize) -> Result<Event> {
        let d = CudaBuffer::of(dst.buffer.as_ref())
            .ok_or_else(|| Error::Device("the cuda copy engine writes only cuda buffers".into()))?;
        let to = d.device_ptr() + dst.offset as u64;
        match src {
            CopySrc::Host(h) => {
                // SAFETY: `src` (holding these bytes) is kept in `Pending` until the event
                // completes.
                unsafe { self.stream.copy_from_host(to, &h.bytes()[..bytes]) }
            }
            CopySrc::Device { buffer, offset } => match CudaBuffer::of(buffer.as_ref()) {
                Some(s) => self
                    .stream
                    .copy_on_device(to, s.device_ptr() + *offset as u64, bytes),
                None => Err(Error::Device(
                    "the cuda copy engine reads only host bytes or cuda buffers".into(),
                )),
            },
        }
    }

    /// Forgets the pending copies that have completed (their sources may go), without waiting.
    fn prune(&self) {
        let mut st = self.lock();
        let mut done = Vec::new();
        for (&s, p) in &st.pending {
            match p.event.done() {
                Ok(true) => done.push((s, None)),
                Ok(false) => break, // later copies complete after this one
                Err(e) => done.push((s, Some(e))),
            }
        }
        for (s, e) in done {
            st.pending.remove(&s);
            if let Some(e) = e {
                st.failed.insert(s, e);
            }
        }
    }

    /// `Ok` for a token of this engine that was issued.
    fn check_token(&self, token: BarrierToken) -> Result<()> {
        if token.engine != self.id {
            return Err(Error::Device(format!(
                "a barrier token of copy engine {} was waited on engine {}",
                token.engine, self.id
            )));
        }
        if token.seq > self.lock().issued {
            return Err(Error::Device(format!(
                "barrier token {} was never issued",
                token.seq
            )));
        }
        Ok(())
    }

    /// Waits for every pending copy up to `seq` and forgets them.
    fn settle(&self, seq: u64) -> Result<()> {
        loop {
            let first = {
                let mut st = self.lock();
                match st.pending.keys().next().copied() {
                    Some(s) if s <= seq => st.pending.remove(&s).map(|p| (s, p)),
                    _ => None,
                }
            };
            let Some((s, p)) = first else {
                return Ok(());
            };
            if let Err(e) = p.event.wait() {
                self.lock().failed.insert(s, e);
            }
        }
    }
}

impl AsyncCopy for CudaCopyEngine {
    type Src = CopySrc;
    type Dst = CopyDst;

    fn issue(&self, src: CopySrc, dst: CopyDst, bytes: usize) -> Result<BarrierToken> {
        check_copy(&src, &dst, bytes)?;
        self.prune();
        let mut st = self.lock();
        let seq = st.issued + 1;
        st.issued = seq;
        match self.start(&src, &dst, bytes) {
            Ok(event) => {
                st.pending.insert(
                    seq,
                    Pending {
                        event,
                        _src: src,
                        _dst: dst,
                    },
                );
            }
            Err(e) => {
                st.failed.insert(seq, e);
            }
        }
        Ok(BarrierToken {
            engine: self.id,
            seq,
        })
    }

    fn wait(&self, token: BarrierToken) -> Result<()> {
        self.check_token(token)?;
        self.settle(token.seq)?;
        match self.lock().failed.get(&token.seq) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn wait_on_device(&self, token: BarrierToken) -> Result<()> {
        self.check_token(token)?;
        self.prune();
        let st = self.lock();
        if let Some(e) = st.failed.get(&token.seq) {
            return Err(e.clone());
        }
        // The copy stream runs copies in issue order: the token's own event covers the earlier
        // ones. Already complete (pruned): nothing to wait for.
        match st.pending.get(&token.seq) {
            Some(p) => self.stream.device().stream_wait(&p.event),
            None => Ok(()),
        }
    }

    fn wait_all(&self) -> Result<()> {
        let issued = self.lock().issued;
        self.settle(issued)?;
        self.lock()
            .failed
            .values()
            .next()
            .map_or(Ok(()), |e| Err(e.clone()))
    }
}

impl Drop for CudaCopyEngine {
    fn drop(&mut self) {
        let _ = self.stream.sync();
    }
}
