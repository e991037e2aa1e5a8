//! The CPU copy engine: one dedicated thread doing the memcpys, in issue order, off the
//! caller's thread; completion is tracked by sequence number under a mutex + condvar.
//!
//! After `fork()` the child has the engine's memory but not its thread: every call there
//! returns an error at once instead of waiting for copies nobody will do, and dropping the
//! engine in the child leaves the parent's thread and channel alone.
use rlx_ir::{AsyncCopy, BarrierToken, Error, Result};
use rlx_runtime::backend::check_copy;
use rlx_runtime::{CopyDst, CopySrc};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

struct Job {
    seq: u64,
    src: CopySrc,
    dst: CopyDst,
    bytes: usize,
}

#[derive(Default)]
struct Progress {
    /// Every copy with `seq <= done` has finished.
    done: u64,
    failed: BTreeMap<u64, Error>,
}

struct Shared {
    progress: Mutex<Progress>,
    finished: Condvar,
}

/// Copies on a background thread. See [`rlx_ir::copy`] for the contract.
pub struct CpuCopyEngine {
    id: u64,
    /// The process that started the worker thread.
    pid: u32,
    /// Issue order and the channel to the worker, under one lock so sequence numbers reach the
    /// worker in order.
    issue: Mutex<(u64, Option<Sender<Job>>)>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl CpuCopyEngine {
    pub fn new() -> Result<CpuCopyEngine> {
        let (tx, rx) = channel::<Job>();
        let shared = Arc::new(Shared {
            progress: Mutex::new(Progress::default()),
            finished: Condvar::new(),
        });
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("rlx-copy".into())
            .spawn(move || {
                for job in rx {
                    let seq = job.seq;
                    let result =
                        catch_unwind(AssertUnwindSafe(|| perform(job))).unwrap_or_else(|_| {
                            Err(Error::Device(
                                "the copy engine panicked during a copy".into(),
                            ))
                        });
                    let mut p = s.progress.lock().unwrap_or_else(|e| e.into_inner());
                    p.done = seq;
                    if let Err(e) = result {
                        p.failed.insert(seq, e);
                    }
                    s.finished.notify_all();
                }
            })
            .map_err(|e| Error::Device(format!("cannot start the copy thread: {e}")))?;
        Ok(CpuCopyEngine {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            pid: std::process::id(),
            issue: Mutex::new((0, Some(tx))),
            shared,
            worker: Some(worker),
        })
    }

    /// Refuses use from a forked child, whose copy thread does not exist.
    fn check_process(&self) -> Result<()> {
        if self.pid == std::process::id() {
            return Ok(());
        }
        Err(Error::Device(
            "this copy engine belongs to the parent process (it was started before fork()); \
             its copies cannot be issued or waited for in the child"
                .into(),
        ))
    }

    /// Whether the engine was started by another process (this one is a forked child).
    pub fn is_inherited(&self) -> bool {
        self.pid != std::process::id()
    }

    fn wait_seq(&self, seq: u64) -> Result<()> {
        let mut p = self
            .shared
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while p.done < seq {
            p = self
                .shared
                .finished
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        match p.failed.get(&seq) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

fn perform(job: Job) -> Result<()> {
    let Job {
        src, dst, bytes, ..
    } = job;
    match src {
        CopySrc::Host(h) => dst.buffer.write(dst.offset, &h.bytes()[..bytes]),
        CopySrc::Device { buffer, offset } => {
            dst.buffer
                .copy_from(dst.offset, buffer.as_ref(), offset, bytes)
        }
    }
}

impl AsyncCopy for CpuCopyEngine {
    type Src = CopySrc;
    type Dst = CopyDst;

    fn issue(&self, src: CopySrc, dst: CopyDst, bytes: usize) -> Result<BarrierToken> {
        self.check_process()?;
        check_copy(&src, &dst, bytes)?;
        let mut issue = self.issue.lock().unwrap_or_else(|e| e.into_inner());
        let seq = issue.0 + 1;
        let tx = issue
            .1
            .as_ref()
            .ok_or_else(|| Error::Device("the copy engine is shut down".into()))?;
        tx.send(Job {
            seq,
            src,
            dst,
            bytes,
        })
        .map_err(|_| Error::Device("the copy thread has stopped".into()))?;
        issue.0 = seq;
        Ok(BarrierToken {
            engine: self.id,
            seq,
        })
    }

    fn wait(&self, token: BarrierToken) -> Result<()> {
        self.check_process()?;
        if token.engine != self.id {
            return Err(Error::Device(format!(
                "a barrier token of copy engine {} was waited on engine {}",
                token.engine, self.id
            )));
        }
        let issued = self.issue.lock().unwrap_or_else(|e| e.into_inner()).0;
        if token.seq > issued {
            return Err(Error::Device(format!(
                "barrier token {} was never issued",
                token.seq
            )));
        }
        self.wait_seq(token.seq)
    }

    fn wait_all(&self) -> Result<()> {
        self.check_process()?;
        let issued = self.issue.lock().unwrap_or_else(|e| e.into_inner()).0;
        self.wait_seq(issued)?;
        let p = self
            .shared
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        p.failed.values().next().map_or(Ok(()), |e| Err(e.clone()))
    }
}

impl Drop for CpuCopyEngine {
    fn drop(&mut self) {
        if self.is_inherited() {
            // A forked child: the worker thread is the parent's. Its handle cannot be joined
            // and the channel may have been mid-operation at the fork, so neither is touched.
            let sender =
                std::mem::take(&mut self.issue.get_mut().unwrap_or_else(|e| e.into_inner()).1);
            std::mem::forget(sender);
            std::mem::forget(self.worker.take());
            return;
        }
        // Closing the channel ends the worker once every queued copy is done.
        self.issue.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBuffer;
    use rlx_runtime::{DeviceBuffer, HostBytes};

    struct Exploding;
    impl HostBytes for Exploding {
        fn bytes(&self) -> &[u8] {
            // Long enough for the issue-time bounds check only on the first call.
            static CALLS: AtomicU64 = AtomicU64::new(0);
            if CALLS.fetch_add(1, Ordering::SeqCst) > 0 {
                panic!("source vanished");
            }
            &[0; 16]
        }
    }

    fn buf(n: usize) -> Arc<dyn DeviceBuffer> {
        Arc::new(CpuBuffer::zeroed(n).unwrap())
    }

    // FIFO completion, covering tokens and in-buffer copies: rlx_runtime::conformance::copy_engine_contract.

    #[test]
    fn bounds_are_checked_at_issue_and_foreign_tokens_refused() {
        let e = CpuCopyEngine::new().unwrap();
        let dst = buf(128);
        let src: Arc<dyn HostBytes> = Arc::new(vec![1u8; 64]);
        assert!(e
            .issue(
                CopySrc::Host(src.clone()),
                CopyDst {
                    buffer: dst.clone(),
                    offset: 100
                },
                64
            )
            .is_err());
        assert!(e
            .issue(
                CopySrc::Host(src),
                CopyDst {
                    buffer: dst.clone(),
                    offset: 0
                },
                65
            )
            .is_err());
        let other = CpuCopyEngine::new().unwrap();
        let t = other
            .issue(
                CopySrc::Host(Arc::new(vec![0u8; 4])),
                CopyDst {
                    buffer: dst,
                    offset: 0,
                },
                4,
            )
            .unwrap();
        assert!(e.wait(t).is_err());
        assert!(e
            .wait(BarrierToken {
                engine: e.id,
                seq: 99
            })
            .is_err());
    }

    #[test]
    fn an_error_inside_a_copy_surfaces_at_the_next_wait() {
        let e = CpuCopyEngine::new().unwrap();
        let dst = buf(64);
        let t = e
            .issue(
                CopySrc::Host(Arc::new(Exploding)),
                CopyDst {
                    buffer: dst.clone(),
                    offset: 0,
                },
                16,
            )
            .unwrap();
        let err = e.wait(t).unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        assert!(
            e.wait(t).is_err(),
            "the error is reported at every wait covering it"
        );
        // Later copies still run.
        let t2 = e
            .issue(
                CopySrc::Host(Arc::new(vec![7u8; 8])),
                CopyDst {
                    buffer: dst.clone(),
                    offset: 0,
                },
                8,
            )
            .unwrap();
        e.wait(t2).unwrap();
        let mut out = [0u8; 8];
        dst.read(0, &mut out).unwrap();
        assert_eq!(out, [7; 8]);
    }

    #[test]
    fn dropping_the_engine_finishes_pending_copies() {
        let dst = buf(1 << 20);
        {
            let e = CpuCopyEngine::new().unwrap();
            for _ in 0..8 {
                let src: Arc<dyn HostBytes> = Arc::new(vec![3u8; 1 << 20]);
                e.issue(
                    CopySrc::Host(src),
                    CopyDst {
                        buffer: dst.clone(),
                        offset: 0,
                    },
                    1 << 20,
                )
                .unwrap();
            }
        }
        let mut out = vec![0; 1 << 20];
        dst.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 3));
    }
}
