//! rlx-metal: the Metal backend (Apple silicon).
#[cfg(target_vendor = "apple")]
mod sys;
