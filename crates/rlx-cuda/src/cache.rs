//! The on-disk PTX cache: NVRTC output keyed by a hash of the source and the architecture, in
//! `$RLX_CUDA_CACHE` (default `$XDG_CACHE_HOME/rlx/cuda` or `~/.cache/rlx/cuda`; `RLX_CUDA_CACHE=0`
//! turns it off). A file that cannot be read or written is simply recompiled.
use rlx_ir::Result;
use std::path::PathBuf;

fn dir() -> Option<PathBuf> {
    match std::env::var("RLX_CUDA_CACHE") {
        Ok(v) if v == "0" => return None,
        Ok(v) if !v.is_empty() => return Some(v.into()),
        _ => {}
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("rlx").join("cuda"))
}

/// The PTX for `source` on `arch`: from the cache, else from `compile` (then stored).
pub fn ptx(
    source: &str,
    arch: &str,
    key: u64,
    compile: impl FnOnce(&str, &str) -> Result<String>,
) -> Result<String> {
    let file = dir().map(|d| d.join(format!("{key:016x}-{arch}.ptx")));
    if let Some(f) = &file {
        if let Ok(text) = std::fs::read_to_string(f) {
            // The first line records the source hash again, guarding against truncated files.
            if let Some(rest) = text.strip_prefix(&format!("// rlx {key:016x}\n")) {
                return Ok(rest.to_string());
            }
        }
    }
    let ptx = compile(source, arch)?;
    if let Some(f) = &file {
        if let Some(parent) = f.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        // Written to a temporary name and renamed, so a reader never sees half a file.
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, format!("// rlx {key:016x}\n{ptx}")).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    #[test]
    fn compiles_once_then_reads_the_cache() {
        let d = std::env::temp_dir().join(format!("rlx-cuda-cache-{}", std::process::id()));
        std::env::set_var("RLX_CUDA_CACHE", &d);
        let mut calls = 0;
        for _ in 0..2 {
            let got = super::ptx("src", "sm_90", 42, |s, a| {
                calls += 1;
                Ok(format!("ptx of {s} for {a}"))
            })
            .unwrap();
            assert_eq!(got, "ptx of src for sm_90");
        }
        assert_eq!(calls, 1);
        let _ = std::fs::remove_dir_all(&d);
    }
}
