//! DLPack export of tensors in GPU memory (`__dlpack__`): a `"dltensor"` capsule over the
//! device memory itself, so PyTorch, CuPy or JAX read and write rlx's weights with no copy.
//! Host-visible memory exports through its numpy view instead. The C structures follow the
//! DLPack ABI (the unversioned `DLManagedTensor` every `from_dlpack` accepts).
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use rlx_ir::DType;
use rlx_runtime::DeviceBuffer;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What a capsule keeps alive: the buffer and the shape and strides its tensor points at.
struct Ctx {
    _buffer: Arc<dyn DeviceBuffer>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

const KDL_CUDA: i32 = 2;
/// The capsule's name until a consumer takes the tensor (it then renames it `used_dltensor`).
const NAME: &CStr = c"dltensor";

/// `(device type, ordinal)` of a buffer's GPU memory (`__dlpack_device__`), if it is a GPU's.
pub fn device(buffer: &dyn DeviceBuffer) -> Option<(i32, usize)> {
    buffer.device_ptr().map(|(_, ordinal)| (KDL_CUDA, ordinal))
}

fn dl_dtype(d: DType) -> DlDataType {
    let (code, bits) = match d {
        DType::F32 => (2, 32),
        DType::F16 => (2, 16),
        DType::F64 => (2, 64),
        DType::BF16 => (4, 16),
        DType::I32 => (0, 32),
        DType::I64 => (0, 64),
        DType::Bool => (6, 8),
    };
    DlDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// Frees a managed tensor made by [`export`] (the consumer calls it once it is done).
unsafe extern "C" fn delete(t: *mut DlManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: `t` and its context were leaked from boxes by `export`, and DLPack calls the
    // deleter once.
    unsafe {
        drop(Box::from_raw((*t).manager_ctx as *mut Ctx));
        drop(Box::from_raw(t));
    }
}

/// The capsule's destructor: frees the tensor unless a consumer took it (renamed the capsule).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython calls this with the capsule being destroyed; a consumed capsule carries
    // another name (its consumer owns the tensor and calls the deleter), so this frees only an
    // unconsumed tensor, exactly once.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let t = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) as *mut DlManagedTensor;
            delete(t);
        }
    }
}

/// A `"dltensor"` capsule over `bytes` of `buffer` at `offset` holding a row-major tensor of
/// `shape` and `dtype`, or `None` when the memory is not a GPU's.
pub fn export(
    py: Python<'_>,
    buffer: &Arc<dyn DeviceBuffer>,
    offset: usize,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Option<Py<PyAny>>> {
    let Some((base, ordinal)) = buffer.device_ptr() else {
        return Ok(None);
    };
    let numel: usize = shape.iter().product();
    let end = numel
        .checked_mul(dtype.size())
        .and_then(|b| b.checked_add(offset));
    if end.is_none_or(|e| e > buffer.len()) {
        return Err(PyValueError::new_err(
            "dlpack: the tensor lies outside its buffer",
        ));
    }
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1] as i64;
    }
    let mut ctx = Box::new(Ctx {
        _buffer: buffer.clone(),
        shape: shape.iter().map(|&d| d as i64).collect(),
        strides,
    });
    let t = Box::new(DlManagedTensor {
        dl_tensor: DlTensor {
            data: base as *mut c_void,
            device: DlDevice {
                device_type: KDL_CUDA,
                device_id: ordinal as i32,
            },
            ndim: shape.len() as i32,
            dtype: dl_dtype(dtype),
            shape: ctx.shape.as_mut_ptr(),
            strides: ctx.strides.as_mut_ptr(),
            byte_offset: offset as u64,
        },
        manager_ctx: Box::into_raw(ctx) as *mut c_void,
        deleter: Some(delete),
    });
    let raw = Box::into_raw(t);
    // SAFETY: `raw` is a live managed tensor; the capsule owns it until a consumer renames the
    // capsule and takes over (then the consumer calls `delete`), else its destructor frees it.
    let capsule =
        unsafe { ffi::PyCapsule_New(raw as *mut c_void, NAME.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so `raw` is still ours to free.
        unsafe { delete(raw) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new, non-null reference returned by PyCapsule_New.
    Ok(Some(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind()))
}
