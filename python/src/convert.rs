//! Python arguments read without PyO3's generic sequence conversion.

use pyo3::prelude::*;

/// A sequence of unsigned 64-bit ints from Python (token ids, block hashes). A list or tuple of
/// plain ints is read item by item through the C API without iterator objects; anything else,
/// and any item that is not a plain int in range, goes through PyO3's own conversion, which
/// gives the error message.
pub(crate) struct U64s(pub(crate) Vec<u64>);

impl<'py> FromPyObject<'_, 'py> for U64s {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Some(v) = fast_u64s(&obj) {
            return Ok(U64s(v));
        }
        obj.extract::<Vec<u64>>().map(U64s)
    }
}

/// A list's or tuple's items as u64s when every one is an int in range, else None (and no
/// Python error left set). Unsafe because PyO3 offers no way to read a list's items without an
/// iterator object and an owned reference per item under the stable ABI, and reading a long
/// prompt's ids that way would be most of a lookup's crossing.
#[allow(unsafe_code)]
pub(crate) fn fast_u64s(obj: &Borrowed<'_, '_, PyAny>) -> Option<Vec<u64>> {
    use pyo3::ffi;
    let p = obj.as_ptr();
    // SAFETY: `p` is a live object (borrowed for this call, the GIL held); the items are read
    // as borrowed references while the sequence is held, and nothing here runs Python code
    // (PyLong_AsUnsignedLongLong on an int does not call __index__), so the sequence cannot
    // change under the loop.
    unsafe {
        let (len, item): (
            ffi::Py_ssize_t,
            unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
        ) = if ffi::PyList_Check(p) != 0 {
            (ffi::PyList_Size(p), ffi::PyList_GetItem)
        } else if ffi::PyTuple_Check(p) != 0 {
            (ffi::PyTuple_Size(p), ffi::PyTuple_GetItem)
        } else {
            return None;
        };
        let mut out = Vec::with_capacity(usize::try_from(len).ok()?);
        for i in 0..len {
            let x = item(p, i);
            if x.is_null() || ffi::PyLong_Check(x) == 0 {
                ffi::PyErr_Clear();
                return None;
            }
            // An unsigned long is 64 bits on the LP64 targets the wheel is built for, and
            // CPython reads it digit by digit, where PyLong_AsUnsignedLongLong takes the
            // byte-array path for every int of more than one digit (a hash is three).
            #[allow(clippy::useless_conversion)] // c_ulong is u64 on LP64, u32 elsewhere
            let v: u64 = ffi::PyLong_AsUnsignedLong(x).into();
            if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            out.push(v);
        }
        Some(out)
    }
}
