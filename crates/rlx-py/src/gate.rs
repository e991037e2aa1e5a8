//! How the bindings enter native code: without the GIL, through the fork gate.
//!
//! Two rules keep Python threads and rlx's locks from deadlocking:
//! * an rlx lock is only ever waited for with the GIL released (`native` detaches first), and
//! * no Python object is touched or dropped inside (callers copy or borrow plain bytes in, and
//!   Python objects are released after `native` returns, with the GIL held again).
//!
//! The fork gate: `os.register_at_fork` (set up in `rlx/__init__.py`) calls `_before_fork`,
//! which waits until no call is inside native code and keeps new ones out until `_after_fork`
//! runs in the parent and in the child. A child therefore never inherits an rlx lock held by a
//! thread that does not exist there. The gate is two atomics, not a lock, for the same reason.
use crate::errors::{guard, IntoPy};
use pyo3::prelude::*;
use rlx_ir::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

static FORKING: AtomicBool = AtomicBool::new(false);
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// One call inside native code; leaving it lets a waiting fork proceed.
struct InCall;

impl InCall {
    fn enter() -> InCall {
        loop {
            while FORKING.load(SeqCst) {
                std::thread::sleep(Duration::from_micros(50));
            }
            ACTIVE.fetch_add(1, SeqCst);
            if !FORKING.load(SeqCst) {
                return InCall;
            }
            ACTIVE.fetch_sub(1, SeqCst);
        }
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, SeqCst);
    }
}

/// Runs `f` with the GIL released, inside the fork gate, with panics turned into errors.
pub fn native<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, Error> + Send) -> PyResult<T> {
    py.detach(|| {
        let _in = InCall::enter();
        guard(f)
    })
    .py_err(py)
}

/// Waits (with the GIL held, so no Python thread starts a new call) until every call inside
/// native code has returned, and keeps new calls out until `_after_fork`.
#[pyfunction]
pub fn _before_fork() {
    FORKING.store(true, SeqCst);
    while ACTIVE.load(SeqCst) > 0 {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Opens the gate again, in the parent and in the child.
#[pyfunction]
pub fn _after_fork() {
    FORKING.store(false, SeqCst);
}
