//! Checkpoints in the safetensors format: atomic saves and fully validated loads.
use crate::{Error, Result};
use rlx_ir::DType;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::fs;
use std::io::Write;
use std::path::Path;

/// One named tensor, owned.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

fn to_st(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::I32 => Dtype::I32,
    }
}

fn err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {what}", path.display()))
}

/// Writes `tensors` to `path` atomically: a temporary file in the same folder is written and
/// synced, then renamed over `path`, so a crash leaves either the old file or the new one.
pub fn save(path: &Path, tensors: &[(&str, DType, &[usize], &[u8])]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(to_st(*dtype), shape.to_vec(), data).map(|v| (name.to_string(), v)).map_err(|e| err(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None).map_err(|e| err(path, e))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let file_name = path.file_name().ok_or_else(|| err(path, "not a file path"))?;
    let tmp = dir.join(format!(".{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err(path, format!("cannot write checkpoint: {e}"))
    })
}

/// Reads and validates every tensor of `path` (header, offsets, sizes, dtypes) before returning.
pub fn load(path: &Path) -> Result<Vec<Tensor>> {
    let bytes = fs::read(path).map_err(|e| err(path, format!("cannot read checkpoint: {e}")))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(path, format!("not a valid safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::I32 => DType::I32,
            other => return Err(err(path, format!("tensor '{name}' has unsupported dtype {other:?}"))),
        };
        out.push(Tensor { name: name.to_string(), dtype, shape: view.shape().to_vec(), data: view.data().to_vec() });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(format!("rlx-ckpt-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let w: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        save(&path, &[("w", DType::F32, &[3], &w)]).unwrap();
        let t = load(&path).unwrap();
        assert_eq!(t, vec![Tensor { name: "w".into(), dtype: DType::F32, shape: vec![3], data: w.clone() }]);
        let names: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
        let full = fs::read(&path).unwrap();
        fs::write(&path, &full[..full.len() - 3]).unwrap();
        assert!(matches!(load(&path), Err(Error::Checkpoint(_))));
        fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
        assert!(matches!(load(&path), Err(Error::Checkpoint(_))));
        fs::remove_dir_all(&dir).unwrap();
    }
}
