//! The `AsyncCopy` trait: copies that start at once and are waited on through barrier tokens.
//!
//! Semantics every implementation keeps:
//! - **Ordering.** Copies issued to one engine complete in issue order (FIFO).
//! - **Tokens.** `issue` returns a [`BarrierToken`] at once. `wait(token)` blocks until that copy
//!   **and every copy issued before it on the same engine** has completed. Tokens are plain values:
//!   waiting twice, or on a token whose copy finished long ago (stale), returns at once with the
//!   same result. A token from another engine is an error.
//! - **Errors.** A copy that fails reports its error at every wait on its own token (and at
//!   `wait_all`); copies after it still run and succeed on their own. Bounds are checked at `issue`: a copy outside its source or destination is an
//!   error there and never touches memory.
//! - **Drop without wait.** Dropping a token does nothing; the copy still completes. Dropping the
//!   engine waits for every issued copy, so no copy outlives the memory it was given.
//! - **Threads.** Engines are `Send + Sync`: any thread may issue or wait.
use crate::Result;

/// Names one issued copy of one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BarrierToken {
    /// Which engine issued it.
    pub engine: u64,
    /// 1-based issue order within that engine.
    pub seq: u64,
}

/// An engine that copies `bytes` from a source to a destination off the caller's thread.
pub trait AsyncCopy: Send + Sync {
    type Src;
    type Dst;
    /// Starts a copy and returns at once.
    fn issue(&self, src: Self::Src, dst: Self::Dst, bytes: usize) -> Result<BarrierToken>;
    /// Blocks until the copy named by `token` and all earlier ones have completed.
    fn wait(&self, token: BarrierToken) -> Result<()>;
    /// Blocks until every copy issued so far has completed.
    fn wait_all(&self) -> Result<()>;
    /// Orders the device's next computation after the copy named by `token` (and all earlier
    /// ones) without blocking the caller where the device can wait by itself (a GPU stream
    /// waiting on the copy's event); the default blocks, as [`AsyncCopy::wait`]. A copy's own
    /// failure may then surface in that computation instead of here.
    fn wait_on_device(&self, token: BarrierToken) -> Result<()> {
        self.wait(token)
    }
}
