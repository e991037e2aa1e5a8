//! Python buffers both ways: `ArenaView` exports a range of device memory (zero-copy numpy views
//! whose base keeps the memory alive), and `Bytes` borrows the bytes of a caller's array.
//! All `unsafe` of the bindings lives here.
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use rlx_runtime::DeviceBuffer;
use std::ffi::c_int;
use std::sync::Arc;

/// A writable byte range of a host-visible device buffer. It holds the buffer, so the memory
/// outlives every numpy array made from it (numpy keeps this object as the array's base).
#[pyclass(module = "rlx._rlx", frozen)]
pub struct ArenaView {
    buffer: Arc<dyn DeviceBuffer>,
    offset: usize,
    len: isize,
}

impl ArenaView {
    /// A view of `len` bytes at `offset`, or `None` when the host cannot see the memory.
    pub fn new(buffer: Arc<dyn DeviceBuffer>, offset: usize, len: usize) -> Option<ArenaView> {
        buffer.host_ptr()?;
        let end = offset.checked_add(len)?;
        (end <= buffer.len()).then_some(ArenaView {
            buffer,
            offset,
            len: len as isize,
        })
    }
}

#[pymethods]
impl ArenaView {
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null Py_buffer"));
        }
        let me = slf.get();
        let base = me
            .buffer
            .host_ptr()
            .ok_or_else(|| PyBufferError::new_err("memory is not host-visible"))?;
        // SAFETY: `new` checked `offset + len` lies inside the buffer; the buffer never moves or
        // frees while this object lives, and `view.obj` below holds a strong reference to it.
        // `shape` points into this frozen object, which outlives the view for the same reason.
        unsafe {
            (*view).buf = base.as_ptr().add(me.offset).cast();
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).len = me.len;
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT != 0 {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND != 0 {
                &me.len as *const isize as *mut isize
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = std::ptr::null_mut();
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }
}

/// The bytes of a C-contiguous Python buffer (a numpy array, bytes, memoryview), borrowed.
pub struct Bytes {
    buf: PyUntypedBuffer,
}

impl Bytes {
    pub fn get(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Bytes> {
        let buf = PyUntypedBuffer::get(obj)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "[{what}] the array must be C-contiguous"
            )));
        }
        Ok(Bytes { buf })
    }

    pub fn as_slice(&self) -> &[u8] {
        let len = self.buf.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer is C-contiguous (checked in `get`) so its `len_bytes` bytes start at
        // `buf_ptr`; the exporter stays alive and keeps the memory while `self.buf` is held.
        // Another Python thread writing the same array concurrently races on plain bytes, as it
        // would with numpy itself.
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr() as *const u8, len) }
    }
}
