//! Data movement kernels: broadcasting and transposition as one strided gather.
use super::{map_rows, Strided};

/// `out[i] = src[offset of i under `how`]`.
pub fn gather<T: Copy + Send + Sync>(src: &[T], how: &Strided, od: &[usize], out: &mut [T]) {
    map_rows(out, od, &[how], |row, st, sp| {
        if sp[0] == 1 {
            row.copy_from_slice(&src[st[0]..st[0] + row.len()]);
        } else {
            for (i, o) in row.iter_mut().enumerate() {
                *o = src[st[0] + i * sp[0]];
            }
        }
    });
}
