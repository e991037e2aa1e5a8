//! Checkpoints in the safetensors format: atomic saves and fully validated loads.
use crate::{Error, Result};
use rlx_ir::DType;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
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
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
    }
}

fn err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {what}", path.display()))
}

/// Where a save to `path` really writes: through symbolic links to their final target (as
/// `np.save` and `torch.save` do, which open the path for writing), so renaming the finished
/// file replaces the target, not the link.
fn resolve_links(path: &Path) -> Result<std::path::PathBuf> {
    let mut at = path.to_path_buf();
    for _ in 0..40 {
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(&at)
                    .map_err(|e| err(path, format!("cannot follow link: {e}")))?;
                at = match at.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            _ => return Ok(at),
        }
    }
    Err(err(path, "too many levels of symbolic links"))
}

/// The prefix of a save's temporary files. File names are limited to 255 bytes, so a long
/// name is shortened (at a character boundary) to leave room for the suffix.
fn tmp_prefix(file_name: &str) -> String {
    let mut end = file_name.len().min(180);
    while !file_name.is_char_boundary(end) {
        end -= 1;
    }
    format!(".{}.tmp-", &file_name[..end])
}

/// Writes `tensors` to `path` atomically: a temporary file in the same folder is written and
/// synced, then renamed over `path`, so a crash leaves either the old file or the new one.
/// A symbolic link is followed: its target is replaced and the link stays.
pub fn save(path: &Path, tensors: &[(&str, DType, &[usize], &[u8])]) -> Result<()> {
    save_with_metadata(path, tensors, None)
}

/// [`save`] with string metadata in the header (`__metadata__`), e.g. the weight layout.
pub fn save_with_metadata(
    path: &Path,
    tensors: &[(&str, DType, &[usize], &[u8])],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let shown = path;
    let target = resolve_links(path)?;
    let path = target.as_path();
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(to_st(*dtype), shape.to_vec(), data)
                .map(|v| (name.to_string(), v))
                .map_err(|e| err(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, metadata).map_err(|e| err(path, e))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| err(path, "not a file path"))?;
    // Unique per process and per call, so concurrent saves never share a temporary file.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = tmp_prefix(&file_name.to_string_lossy());
    let tmp = dir.join(format!("{prefix}{}-{n}", std::process::id()));
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
        err(shown, format!("cannot write checkpoint: {e}"))
    })?;
    remove_stale_temporaries(&dir, &prefix);
    Ok(())
}

/// Deletes temporary files that earlier saves of this file left behind when their process died
/// mid-write (`.NAME.tmp-PID-N` whose PID no longer runs). Linux only; best effort.
fn remove_stale_temporaries(dir: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let gone = cfg!(target_os = "linux") && !Path::new("/proc").join(pid.to_string()).exists();
        if pid != std::process::id() && gone {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Headers larger than this are refused (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Top-level keys of the JSON header, duplicates kept (a map would silently drop them).
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Keys, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    m.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(k);
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(serde::Deserialize)]
struct Entry {
    data_offsets: (u64, u64),
    #[serde(default)]
    dtype: String,
    #[serde(default)]
    shape: Vec<u64>,
}

impl Entry {
    /// Where the entry's bytes disagree with its dtype and shape (a dtype safetensors knows),
    /// what to say about tensor `name`.
    fn size_mismatch(&self, name: &str) -> Option<String> {
        let dtype: Dtype =
            serde_json::from_value(serde_json::Value::String(self.dtype.clone())).ok()?;
        let bits = self
            .shape
            .iter()
            .try_fold(dtype.bitsize() as u64, |acc, &d| acc.checked_mul(d))?;
        if bits & 7 != 0 {
            return None; // sub-byte dtypes: the safetensors reader judges those
        }
        let want = bits / 8;
        let (start, end) = self.data_offsets;
        let have = end.checked_sub(start)?;
        (have != want).then(|| {
            format!(
                "tensor '{name}' is {} {:?} ({want} bytes) but its data_offsets span {have} bytes",
                self.dtype, self.shape
            )
        })
    }
}

#[derive(serde::Deserialize)]
struct Described {
    dtype: String,
    shape: Vec<usize>,
}

/// One tensor as a file's header describes it: name, safetensors dtype name (`"F32"`,
/// `"BF16"`, ...) and shape.
pub type HeaderEntry = (String, String, Vec<usize>);

/// Reads only the header of `path` (at most the header's bytes plus eight) and lists its
/// tensors sorted by name, so a caller can compare names, dtypes and shapes with a model
/// before any data is read. Refuses what `load` refuses about the header itself.
pub fn header(path: &Path) -> Result<Vec<HeaderEntry>> {
    let (text, ..) = read_header(path)?;
    let entries: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| err(path, format!("bad header: {e}")))?;
    entries
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| {
            let d: Described = serde_json::from_value(v)
                .map_err(|e| err(path, format!("bad entry '{name}': {e}")))?;
            Ok((name, d.dtype, d.shape))
        })
        .collect()
}

/// The header's JSON text (checked to be UTF-8, within limits and without duplicate names),
/// its 8-byte length prefix, the file's length, and the open file positioned after the header.
fn read_header(path: &Path) -> Result<(String, [u8; 8], u64, fs::File)> {
    use std::io::Read;
    let meta = fs::metadata(path).map_err(|e| err(path, format!("cannot read checkpoint: {e}")))?;
    if !meta.is_file() {
        return Err(err(path, "not a regular file"));
    }
    let file_len = meta.len();
    let mut f =
        fs::File::open(path).map_err(|e| err(path, format!("cannot read checkpoint: {e}")))?;
    let mut len8 = [0u8; 8];
    f.read_exact(&mut len8)
        .map_err(|_| err(path, "truncated: no header length"))?;
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER || n.saturating_add(8) > file_len {
        return Err(err(
            path,
            format!("header length {n} does not fit a file of {file_len} bytes"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|_| err(path, "truncated header"))?;
    let text = String::from_utf8(header).map_err(|_| err(path, "the header is not UTF-8"))?;
    let keys: Keys =
        serde_json::from_str(&text).map_err(|e| err(path, format!("bad header: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = keys.0.iter().find(|k| !seen.insert(k.as_str())) {
        return Err(err(path, format!("the header names '{dup}' twice")));
    }
    Ok((text, len8, file_len, f))
}

/// One named tensor as stored, in any of the dtypes [`load_raw`] accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    pub name: String,
    /// numpy's name of the stored dtype: `"float32"`, `"bfloat16"`, `"int64"`, ...
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

fn dtype_name(d: Dtype) -> Option<&'static str> {
    Some(match d {
        Dtype::BOOL => "bool",
        Dtype::U8 => "uint8",
        Dtype::I8 => "int8",
        Dtype::I16 => "int16",
        Dtype::U16 => "uint16",
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        Dtype::I32 => "int32",
        Dtype::U32 => "uint32",
        Dtype::F32 => "float32",
        Dtype::I64 => "int64",
        Dtype::U64 => "uint64",
        Dtype::F64 => "float64",
        _ => return None,
    })
}

/// Reads and validates every tensor of `path` (header, offsets, sizes, dtypes) before returning;
/// only tensors of rlx's dtypes ([`DType`]) are accepted (see [`load_raw`] for the others).
pub fn load(path: &Path, max_bytes: Option<u64>) -> Result<Vec<Tensor>> {
    let (raw, _) = load_raw(path, max_bytes)?;
    raw.into_iter()
        .map(|t| {
            let dtype = DType::parse(t.dtype).ok_or_else(|| {
                err(
                    path,
                    format!("tensor '{}' has unsupported dtype {}", t.name, t.dtype),
                )
            })?;
            Ok(Tensor {
                name: t.name,
                dtype,
                shape: t.shape,
                data: t.data,
            })
        })
        .collect()
}

/// Reads and validates every tensor of `path` (header, offsets, sizes, dtypes) and the header's
/// string metadata, in any common dtype (the caller converts).
///
/// Nothing large is read before the header has been checked against the file: a FIFO, a device
/// or a file whose size disagrees with its header is refused after at most the header's bytes,
/// and so is one holding more than `max_bytes` of tensor data (the caller's expectation).
pub fn load_raw(
    path: &Path,
    max_bytes: Option<u64>,
) -> Result<(Vec<RawTensor>, HashMap<String, String>)> {
    use std::io::Read;
    let (text, len8, file_len, f) = read_header(path)?;
    let n = text.len() as u64;
    let header = text.as_bytes();
    let entries: std::collections::HashMap<String, serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| err(path, format!("bad header: {e}")))?;
    let mut data_end = 0u64;
    for (name, v) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let e: Entry = serde_json::from_value(v.clone())
            .map_err(|e| err(path, format!("bad entry '{name}': {e}")))?;
        if let Some(why) = e.size_mismatch(name) {
            return Err(err(path, why));
        }
        data_end = data_end.max(e.data_offsets.1);
    }
    let data_len = file_len - 8 - n;
    if data_end != data_len {
        return Err(err(
            path,
            format!("the header describes {data_end} bytes of data but the file holds {data_len}"),
        ));
    }
    if let Some(limit) = max_bytes {
        if data_len > limit {
            return Err(err(
                path,
                format!("the checkpoint holds {data_len} bytes of tensors; the model has {limit}"),
            ));
        }
    }
    let mut bytes = Vec::with_capacity((8 + n + data_len) as usize);
    bytes.extend_from_slice(&len8);
    bytes.extend_from_slice(header);
    f.take(data_len)
        .read_to_end(&mut bytes)
        .map_err(|e| err(path, format!("cannot read checkpoint: {e}")))?;
    if bytes.len() as u64 != 8 + n + data_len {
        return Err(err(path, "the file changed while it was read"));
    }
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(path, format!("not a valid safetensors file: {e}")))?;
    let metadata = SafeTensors::read_metadata(&bytes)
        .map(|(_, m)| m.metadata().clone().unwrap_or_default())
        .map_err(|e| err(path, format!("not a valid safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (name, view) in st.iter() {
        let dtype = dtype_name(view.dtype()).ok_or_else(|| {
            err(
                path,
                format!("tensor '{name}' has unsupported dtype {:?}", view.dtype()),
            )
        })?;
        out.push(RawTensor {
            name: name.to_string(),
            dtype,
            shape: view.shape().to_vec(),
            data: view.data().to_vec(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((out, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(format!("rlx-ckpt-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let w: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        save(&path, &[("w", DType::F32, &[3], &w)]).unwrap();
        let t = load(&path, None).unwrap();
        assert_eq!(
            t,
            vec![Tensor {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![3],
                data: w.clone()
            }]
        );
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
        // A temporary file of a dead writer (a PID above any pid_max) is cleaned up.
        let stale = dir.join(".m.safetensors.tmp-4000000000-0");
        fs::write(&stale, b"partial").unwrap();
        save(&path, &[("w", DType::F32, &[3], &w)]).unwrap();
        assert!(
            !stale.exists() || !cfg!(target_os = "linux"),
            "a dead writer's temporary file is removed"
        );
        let full = fs::read(&path).unwrap();
        fs::write(&path, &full[..full.len() - 3]).unwrap();
        assert!(matches!(load(&path, None), Err(Error::Checkpoint(_))));
        fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
        assert!(matches!(load(&path, None), Err(Error::Checkpoint(_))));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A header whose dtype disagrees with the bytes it gives a tensor names that tensor (the
    /// total-size check after it used to speak only of the whole file's bytes).
    #[test]
    fn a_tensor_whose_dtype_disagrees_with_its_bytes_is_named() {
        let dir = std::env::temp_dir().join(format!("rlx-ckpt-size-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let header = br#"{"w":{"dtype":"F16","shape":[3],"data_offsets":[0,12]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0u8; 12]);
        fs::write(&path, &file).unwrap();
        let e = load_raw(&path, Some(6)).unwrap_err().to_string();
        assert!(
            e.contains("tensor 'w' is F16 [3] (6 bytes) but its data_offsets span 12 bytes"),
            "{e}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_dtype_round_trips_with_its_size() {
        let dir = std::env::temp_dir().join(format!("rlx-ckpt-dtypes-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("all.safetensors");
        let names: Vec<String> = DType::ALL.iter().map(|d| format!("t_{d}")).collect();
        let datas: Vec<Vec<u8>> = DType::ALL
            .iter()
            .enumerate()
            .map(|(k, d)| (0..3 * d.size()).map(|i| (i * 7 + k) as u8 % 2).collect())
            .collect();
        let shape = [3usize];
        let tensors: Vec<(&str, DType, &[usize], &[u8])> = DType::ALL
            .iter()
            .enumerate()
            .map(|(k, d)| (names[k].as_str(), *d, &shape[..], datas[k].as_slice()))
            .collect();
        save(&path, &tensors).unwrap();
        let mut back = load(&path, None).unwrap();
        back.sort_by_key(|t| DType::ALL.iter().position(|d| *d == t.dtype));
        for (k, t) in back.iter().enumerate() {
            assert_eq!(
                (t.dtype, &t.data, &t.shape),
                (DType::ALL[k], &datas[k], &vec![3])
            );
        }
        // A wrong byte count for the dtype is refused at save.
        let short = [0u8; 5];
        let bad = save(&path, &[("x", DType::F16, &[3], &short)]);
        assert!(matches!(bad, Err(Error::Checkpoint(_))), "{bad:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn saves_follow_links_and_accept_the_longest_names() {
        let dir = std::env::temp_dir().join(format!("rlx-ckpt-links-{}", std::process::id()));
        fs::create_dir_all(dir.join("real")).unwrap();
        let w = 7.0f32.to_le_bytes();
        let target = dir.join("real").join("m.safetensors");
        let link = dir.join("link.safetensors");
        std::os::unix::fs::symlink("real/m.safetensors", &link).unwrap();
        save(&link, &[("w", DType::F32, &[1], &w)]).unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(load(&target, None).unwrap()[0].data, w);
        let long = dir.join("x".repeat(252));
        save(&long, &[("w", DType::F32, &[1], &w)]).unwrap();
        assert_eq!(load(&long, None).unwrap()[0].data, w);
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            3,
            "no temporaries left"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
