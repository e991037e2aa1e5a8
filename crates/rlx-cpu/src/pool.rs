//! The worker threads kernels run on, how a forked child gets its own, and how they stay awake
//! for the length of one program run.
//!
//! A program run is a few dozen to a few hundred instructions, many of them split over the
//! threads. Rayon's idle workers go to sleep within microseconds, so every parallel
//! instruction used to pay for waking one (a futex wake, tens of microseconds on a VM) and the
//! calling thread for waiting on it. Now the whole run is one job on the pool: one worker drives
//! the instructions and the others keep polling for the work it splits off (`keep_awake`) until
//! the run ends, so a split costs a deque push and a steal. Idle pollers yield to the OS now and
//! then, so a copy thread or another process still gets the cores.
//!
//! The thread that first runs a program (in Python, nearly always the main thread) becomes
//! worker 0 of the global pool, which starts one thread fewer: its runs are driven where they
//! were called, with no hand-off to a pool thread and no wake-up of the caller at the end (the
//! digits MLP's step, 0.37 -> 0.35 ms on two cores). Runs from other threads are handed to the
//! pool as before; worker 0 takes no part in them (it steals only while it runs a program
//! itself), so this is done only where the pool has at least two threads.
//!
//! A forked child inherits the parent's memory but none of its threads, so rayon's global pool
//! would accept work in the child and never run it (a hang). The process that first runs a
//! program keeps using the global pool directly. Any other process — a child forked after
//! that — gets a private pool, made once per process, and programs run inside it; the pool of
//! an earlier process is leaked, never dropped (its threads do not exist here, so it can be
//! neither joined nor shut down).
use rlx_ir::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The process whose rayon global pool serves programs.
static ORIGIN: OnceLock<u32> = OnceLock::new();

/// A forked child's private pool, with the process it belongs to.
static CHILD_POOL: Mutex<Option<(u32, Arc<rayon::ThreadPool>)>> = Mutex::new(None);

/// Threads a pool uses: `RLX_NUM_THREADS`, else `RAYON_NUM_THREADS`, else every core.
pub fn thread_count() -> usize {
    ["RLX_NUM_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs `f` where its parallel loops find live worker threads.
pub fn run<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let pid = std::process::id();
    if *ORIGIN.get_or_init(|| {
        // The global pool is sized like a private one would be. The calling thread joins it
        // only where another worker serves the runs of other threads (see above), and not when
        // it is a worker of some other pool already (that build would fail, and rayon tries to
        // build its global pool only once).
        let threads = thread_count();
        let mut builder = rayon::ThreadPoolBuilder::new().num_threads(threads);
        if threads >= 2 && rayon::current_thread_index().is_none() {
            builder = builder.use_current_thread();
        }
        let _ = builder.build_global();
        pid
    }) == pid
    {
        return awake(f);
    }
    child_pool(pid)?.install(|| awake(f))
}

/// Sets the flag when dropped (also when the run panics, so the pollers stop).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `f` on a worker of the current pool (the global one when called from outside any pool)
/// while the pool's other workers poll for the work it splits off. On a pool of one thread
/// (`RLX_NUM_THREADS=1`) the run goes to that worker whole, where its parallel loops run
/// inline: run from outside, each loop would be handed to the worker and waited for on its
/// own (a futex wake and wait a loop: the tiny GPT's step took 64 ms instead of 50).
fn awake<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if rayon::current_num_threads() < 2 {
        if rayon::current_thread_index().is_some() {
            return f();
        }
        return rayon::join(f, || ()).0;
    }
    let done = AtomicBool::new(false);
    let driver = AtomicUsize::new(usize::MAX);
    let (result, ()) = rayon::join(
        || {
            let _done = SetOnDrop(&done);
            if let Some(i) = rayon::current_thread_index() {
                driver.store(i, Ordering::Release);
            }
            f()
        },
        || keep_awake(&done, &driver),
    );
    result
}

/// Polls the pool for work until `done`. Returns at once on the driving thread itself (which
/// pops this job when nobody stole it, or while it waits inside the run: polling there until
/// the run ends would never end).
fn keep_awake(done: &AtomicBool, driver: &AtomicUsize) {
    if rayon::current_thread_index() == Some(driver.load(Ordering::Acquire)) {
        return;
    }
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            idle = 0;
            continue;
        }
        idle = idle.wrapping_add(1);
        if idle & 63 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// This (forked) process's private pool, made on first use.
fn child_pool(pid: u32) -> Result<Arc<rayon::ThreadPool>> {
    // The fork gate of the Python bindings keeps every call out of rlx while a fork happens,
    // so this lock is never inherited held.
    let mut slot = CHILD_POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, pool)) = slot.as_ref().filter(|(p, _)| *p == pid) {
        return Ok(pool.clone());
    }
    if let Some(stale) = slot.take() {
        std::mem::forget(stale); // a grandparent's pool: its threads are gone
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(thread_count())
        .thread_name(|i| format!("rlx-cpu-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Device(format!("cannot start the CPU worker threads: {e}")))?;
    *slot = Some((pid, pool.clone()));
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    #[test]
    fn a_run_splits_work_and_returns_its_result() {
        let sum = super::run(|| Ok((0..100_000u64).into_par_iter().sum::<u64>())).unwrap();
        assert_eq!(sum, 100_000 * 99_999 / 2);
        // Runs inside a run, and errors, come back as they are.
        let nested = super::run(|| super::run(|| Ok(7))).unwrap();
        assert_eq!(nested, 7);
        let err = super::run(|| -> rlx_ir::Result<()> { Err(rlx_ir::Error::Device("x".into())) });
        assert!(err.is_err());
    }

    #[test]
    fn a_panicking_run_stops_the_pollers() {
        let r =
            std::panic::catch_unwind(|| super::run(|| -> rlx_ir::Result<()> { panic!("boom") }));
        assert!(r.is_err());
        // The pool still works afterwards (no worker is left polling for the dead run).
        assert_eq!(super::run(|| Ok(1)).unwrap(), 1);
    }
}
