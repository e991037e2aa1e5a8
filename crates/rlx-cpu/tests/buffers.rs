//! `CpuBuffer` through its safe `DeviceBuffer` methods: empty buffers are aligned, bounds are
//! checked, and overlapping writes, reads and copies from several threads are race-free (each
//! byte ends up as one of the values written to it).
use rlx_cpu::{CpuBuffer, ALIGN};
use rlx_runtime::DeviceBuffer;
use std::sync::Arc;

#[test]
fn empty_buffers_have_an_aligned_non_null_address() {
    let b = CpuBuffer::zeroed(0).unwrap();
    assert_eq!(b.host_ptr().unwrap().as_ptr() as usize % ALIGN, 0);
    assert!(b.write(0, &[]).is_ok());
    assert!(b.write(0, &[1]).is_err());
}

#[test]
fn out_of_range_copies_are_refused_and_change_nothing() {
    let b = CpuBuffer::zeroed(8).unwrap();
    let e = b.write(6, &[1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("outside a buffer of 8 bytes"), "{e}");
    assert!(b.read(usize::MAX, &mut [0; 2]).is_err());
    assert!(b.copy_from(0, &b, 4, 5).is_err());
    let mut out = [9u8; 8];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, [0; 8]);
}

#[test]
fn overlapping_copies_within_one_buffer_move_like_memmove() {
    let b = CpuBuffer::zeroed(16).unwrap();
    b.write(0, &(0u8..16).collect::<Vec<_>>()).unwrap();
    b.copy_from(2, &b, 0, 10).unwrap(); // forwards overlap
    let mut out = [0u8; 16];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15]);
    b.copy_from(0, &b, 3, 10).unwrap(); // backwards overlap
    b.read(0, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 8, 9, 12, 13, 14, 15]);
}

#[test]
fn concurrent_overlapping_writes_and_reads_leave_written_values() {
    let b = Arc::new(CpuBuffer::zeroed(128).unwrap());
    std::thread::scope(|s| {
        for t in 1..=4u8 {
            let b = b.clone();
            s.spawn(move || {
                let data = vec![t; 64];
                for _ in 0..2000 {
                    b.write(t as usize * 16, &data).unwrap();
                    b.copy_from(0, b.as_ref(), 64, 64).unwrap();
                }
            });
        }
        let b = b.clone();
        s.spawn(move || {
            let mut out = vec![0u8; 128];
            for _ in 0..2000 {
                b.read(0, &mut out).unwrap();
                assert!(out.iter().all(|&v| v <= 4), "a byte no one wrote: {out:?}");
            }
        });
    });
    let mut out = vec![0u8; 128];
    b.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&v| v <= 4));
    assert!(
        out[16..].iter().all(|&v| v >= 1),
        "every written byte holds a writer's value"
    );
}
