//! The worker threads kernels run on, and how a forked child gets its own.
//!
//! A forked child inherits the parent's memory but none of its threads, so rayon's global pool
//! would accept work in the child and never run it (a hang). The process that first runs a
//! program keeps using the global pool directly (no hand-off: the calling thread takes part, as
//! before). Any other process — a child forked after that — gets a private pool, made once per
//! process, and programs run inside it; the pool of an earlier process is leaked, never dropped
//! (its threads do not exist here, so it can be neither joined nor shut down).
use rlx_ir::{Error, Result};
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
        // The global pool is sized like a private one would be.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(thread_count())
            .build_global();
        pid
    }) == pid
    {
        return f();
    }
    child_pool(pid)?.install(f)
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
    #[test]
    fn the_first_process_runs_on_the_calling_thread() {
        let here = std::thread::current().id();
        let ran_on = super::run(|| Ok(std::thread::current().id())).unwrap();
        assert_eq!(here, ran_on);
    }
}
