//! The worker threads kernels run on: one rayon pool per process, re-created after `fork()`.
//!
//! A forked child inherits the parent's memory but none of its threads, so a pool made before
//! the fork would accept work in the child and never run it (a hang). The pool therefore
//! remembers the process that made it; a child makes its own on first use and leaks the
//! parent's (its threads do not exist here, so it can be neither joined nor dropped safely).
use rlx_ir::{Error, Result};
use std::sync::{Arc, Mutex};

struct Owned {
    pid: u32,
    pool: Arc<rayon::ThreadPool>,
}

static POOL: Mutex<Option<Owned>> = Mutex::new(None);

/// Threads the pool uses: `RLX_NUM_THREADS`, else `RAYON_NUM_THREADS`, else every core.
pub fn thread_count() -> usize {
    ["RLX_NUM_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// This process's pool, made on first use (again in a forked child).
pub fn pool() -> Result<Arc<rayon::ThreadPool>> {
    let pid = std::process::id();
    // A child forked while another thread held this lock would inherit it locked; the fork gate
    // of the Python bindings keeps every call out of rlx while a fork happens.
    let mut slot = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(o) = slot.as_ref().filter(|o| o.pid == pid) {
        return Ok(o.pool.clone());
    }
    if let Some(stale) = slot.take() {
        // Made by the parent process: its threads are gone. Never drop it.
        std::mem::forget(stale);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(thread_count())
        .thread_name(|i| format!("rlx-cpu-{i}"))
        .build()
        .map_err(|e| Error::Device(format!("cannot start the CPU worker threads: {e}")))?;
    let pool = Arc::new(pool);
    *slot = Some(Owned {
        pid,
        pool: pool.clone(),
    });
    Ok(pool)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pool_is_made_once_per_process() {
        let a = super::pool().unwrap();
        let b = super::pool().unwrap();
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert_eq!(a.current_num_threads(), super::thread_count());
    }
}
