//! Tests of the Metal backend's parts on the host-emulated device: the MSL kernels (compiled by
//! the system C++ compiler) against reference results, the copy engine's ordering and errors, and
//! device-side waits. Skipped, with a message, where there is no C++ compiler.
use crate::gpu::Dispatch;
use crate::kernels::{self, Gemm};
use crate::matmul::MatmulPolicy;
use crate::{host, MetalBuffer, MetalDevice};
use rlx_ir::{AsyncCopy, BarrierToken, Error};
use rlx_runtime::gpu_plan::P;
use rlx_runtime::{Buf, CopyDst, CopySrc, DeviceBuffer, Instr, Program, TRef};
use std::sync::Arc;

fn device() -> Option<MetalDevice> {
    if host::cxx().is_none() {
        eprintln!("skipped: no C++ compiler to build the MSL kernels for the host");
        return None;
    }
    Some(MetalDevice::host().expect("host-emulated Metal device"))
}

fn put(buf: &MetalBuffer, v: &[f32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
    buf.write(0, &bytes).unwrap();
}

fn get(buf: &MetalBuffer, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    buf.read(0, &mut bytes).unwrap();
    bytes
        .chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn every_planned_kernel_is_in_the_library() {
    let names = host::kernel_names(kernels::LIBRARY);
    for k in kernels::NAMES {
        assert!(names.iter().any(|n| n == k), "{k} missing from {names:?}");
    }
    assert_eq!(kernels::record(&P::default()).len(), kernels::RECORD_BYTES);
}

#[test]
fn fused_kernels_are_generated_from_the_shared_expressions() {
    use rlx_ir::{BinaryOp as B, Fused, FusedStep, Shape, UnaryOp as U};
    let f = Fused {
        shape: Shape::new([4]),
        n_inputs: 2,
        steps: vec![
            FusedStep::Binary(B::Mul, 0, 1),
            FusedStep::Unary(U::PowScalar(1.5), 2),
        ],
    };
    let src = kernels::fused_kernel("k7", &f);
    assert!(src.contains("kernel void k7(constant P& p"), "{src}");
    assert!(src.contains("float r2 = (r0 * r1);"), "{src}");
    assert!(src.contains("rx_pow(r2, rx_bits(0x3fc00000))"), "{src}");
    assert!(src.contains("F(2)[off(p, 2, i)] = r3;"), "{src}");
}

#[test]
fn gemm_kernel_matches_reference_with_strides_and_batches() {
    let Some(dev) = device() else { return };
    for &(m, n, k, ta, batch) in &[
        (1, 1, 1, false, 1),
        (7, 5, 9, false, 2),
        (13, 18, 6, true, 1),
        (33, 31, 17, true, 3),
    ] {
        let (a, b) = (data(batch * m * k, 3), data(batch * k * n, 4));
        let (ba, bb, bc) = (
            dev.alloc(a.len() * 4).unwrap(),
            dev.alloc(b.len() * 4).unwrap(),
            dev.alloc(batch * m * n * 4).unwrap(),
        );
        put(&ba, &a);
        put(&bb, &b);
        // `a` holds A (m x k) row-major, or A^T (k x m) row-major when `ta`.
        let a_at = |z: usize, i: usize, q: usize| {
            let a = &a[z * m * k..];
            if ta {
                a[q * m + i]
            } else {
                a[i * k + q]
            }
        };
        let g = Gemm {
            a: ba.address(0).unwrap(),
            b: bb.address(0).unwrap(),
            c: bc.address(0).unwrap(),
            m,
            n,
            k,
            batch,
            a_strides: if ta { (1, m) } else { (k, 1) },
            b_strides: (n, 1),
            c_row: n,
            a_batch: m * k,
            b_batch: k * n,
            c_batch: m * n,
        };
        let (rec, threads) = g.record().unwrap();
        let d = Dispatch {
            library: dev.library().as_ref(),
            kernel: "rlx_gemm_f32",
            record: &rec,
            threads,
        };
        dev.run(None, &[d], &[&ba, &bb, &bc]).unwrap();
        let mut want = vec![0f32; batch * m * n];
        for z in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let s: f32 = (0..k)
                        .map(|q| a_at(z, i, q) * b[z * k * n + q * n + j])
                        .sum();
                    want[z * m * n + i * n + j] = s;
                }
            }
        }
        close(&get(&bc, batch * m * n), &want, 1e-4);
    }
}

#[test]
fn buffers_are_zero_copy_host_views() {
    let Some(dev) = device() else { return };
    let buf = dev.alloc(64).unwrap();
    let p = buf.host_ptr().unwrap();
    assert_eq!(p.as_ptr() as usize as u64, buf.address(0).unwrap());
    put(&buf, &[1.0; 16]);
    // log1p in place, through the record's GPU addresses
    let mut p = P::sized(16);
    p.ptr[0] = buf.address(0).unwrap();
    p.ptr[1] = buf.address(0).unwrap();
    let rec = kernels::record(&p);
    dev.run(
        None,
        &[Dispatch {
            library: dev.library().as_ref(),
            kernel: "rlx_log1p",
            record: &rec,
            threads: 16,
        }],
        &[&buf],
    )
    .unwrap();
    close(&get(&buf, 16), &[std::f32::consts::LN_2; 16], 1e-6);
    assert!(matches!(buf.address(65), Err(Error::Bounds(_))));
    assert!(matches!(buf.write(60, &[0; 8]), Err(Error::Bounds(_))));
}

/// A host GPU the test can hold the blit queue of, and the device over it.
fn held_device() -> Option<(Arc<host::HostGpu>, MetalDevice)> {
    device()?;
    let gpu = Arc::new(host::HostGpu::new().unwrap());
    let dev = MetalDevice::new(gpu.clone(), crate::Dialect::HostCxx).unwrap();
    Some((gpu, dev))
}

/// Lets the blit queue go after a moment (long enough for the caller to have submitted what
/// it tests, even on a busy machine), from another thread.
fn release_later(gpu: &Arc<host::HostGpu>) -> std::thread::JoinHandle<()> {
    let gpu = gpu.clone();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(400));
        gpu.hold_blits(false);
    })
}

#[test]
fn wait_on_device_orders_the_next_submission_without_blocking_the_host() {
    let Some((gpu, dev)) = held_device() else {
        return;
    };
    let eng = dev.copy_engine().unwrap();
    let n = 4096;
    let src = dev.alloc(n * 4).unwrap();
    let dst = dev.alloc(n * 4).unwrap();
    put(&src, &data(n, 9));
    gpu.hold_blits(true);
    let host_bytes: Arc<Vec<u8>> =
        Arc::new(data(n, 7).iter().flat_map(|x| x.to_ne_bytes()).collect());
    let dst_dyn: Arc<dyn DeviceBuffer> = dst.clone();
    let t = eng
        .issue(
            CopySrc::Host(host_bytes),
            CopyDst {
                buffer: dst_dyn,
                offset: 0,
            },
            n * 4,
        )
        .unwrap();
    // The copy cannot run (the queue is held): a blocking wait would never return here.
    eng.wait_on_device(t).unwrap();
    let (event, value) = eng.device_wait(t).unwrap();
    assert!(event.signaled_value() < value, "the copy ran while held");
    assert_eq!(dev.pending_device_waits(), 1);
    // out = dst + src, submitted with no explicit wait: the recorded one orders it.
    let out = dev.alloc(n * 4).unwrap();
    let add = rlx_ir::Fused {
        shape: rlx_ir::Shape::new([n]),
        n_inputs: 2,
        steps: vec![rlx_ir::FusedStep::Binary(rlx_ir::BinaryOp::Add, 0, 1)],
    };
    let lib = dev
        .compile_cached(&kernels::fused_kernel("add", &add))
        .unwrap();
    let mut p = P::sized(n);
    p.ptr[..3].copy_from_slice(&[
        dst.address(0).unwrap(),
        src.address(0).unwrap(),
        out.address(0).unwrap(),
    ]);
    p.mode[..3].copy_from_slice(&[1, 1, 1]);
    let rec = kernels::record(&p);
    let release = release_later(&gpu);
    dev.run(
        None,
        &[Dispatch {
            library: lib.as_ref(),
            kernel: "add",
            record: &rec,
            threads: n,
        }],
        &[&src, &dst, &out],
    )
    .unwrap();
    release.join().unwrap();
    assert_eq!(
        gpu.last_waits(),
        vec![host::RecordedWait {
            value,
            reached_at_submit: false
        }],
        "the submission did not wait on the device for the copy"
    );
    assert_eq!(dev.pending_device_waits(), 0, "the wait was not taken");
    let want: Vec<f32> = data(n, 7)
        .iter()
        .zip(data(n, 9))
        .map(|(x, y)| x + y)
        .collect();
    close(&get(&out, n), &want, 1e-6);
    // The next submission has nothing left to wait for.
    dev.run(None, &[], &[&out]).unwrap();
    assert!(gpu.last_waits().is_empty());
    // A token whose copy completed needs no device wait at all.
    eng.wait_on_device(t).unwrap();
    assert_eq!(dev.pending_device_waits(), 0);
}

#[test]
fn host_access_waits_for_a_copy_in_flight_over_its_bytes() {
    let Some((gpu, dev)) = held_device() else {
        return;
    };
    let eng = dev.copy_engine().unwrap();
    let dst = dev.alloc(1024).unwrap();
    gpu.hold_blits(true);
    let dst_dyn: Arc<dyn DeviceBuffer> = dst.clone();
    let t = eng
        .issue(
            CopySrc::Host(Arc::new(vec![5u8; 256])),
            CopyDst {
                buffer: dst_dyn,
                offset: 256,
            },
            256,
        )
        .unwrap();
    eng.wait_on_device(t).unwrap();
    // Bytes the copy does not touch are read at once (the queue is still held).
    let mut out = vec![1u8; 256];
    dst.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 0));
    // A read of the copied bytes waits for the copy on the host.
    let release = release_later(&gpu);
    dst.read(256, &mut out).unwrap();
    release.join().unwrap();
    assert!(
        out.iter().all(|&b| b == 5),
        "a host read raced with the copy"
    );
    // Writes too: a write after the copy is not overwritten by it.
    gpu.hold_blits(true);
    let dst_dyn: Arc<dyn DeviceBuffer> = dst.clone();
    eng.issue(
        CopySrc::Host(Arc::new(vec![6u8; 256])),
        CopyDst {
            buffer: dst_dyn,
            offset: 0,
        },
        256,
    )
    .unwrap();
    let release = release_later(&gpu);
    dst.write(128, &[9u8; 64]).unwrap();
    release.join().unwrap();
    eng.wait_all().unwrap();
    dst.read(0, &mut out).unwrap();
    assert!(out[..128].iter().all(|&b| b == 6));
    assert!(
        out[128..192].iter().all(|&b| b == 9),
        "the copy overwrote a later write"
    );
}

/// Runs `f` on a thread of its own; panics if it takes longer than `secs` (a hang fails).
fn within(secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(()) => t.join().unwrap(),
        // the thread panicked: report its panic
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => t.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("hung for {secs} s"),
    }
}

#[test]
fn a_failed_blit_is_an_error_not_a_hang() {
    within(60, failed_blits);
}

fn failed_blits() {
    let Some((gpu, dev)) = held_device() else {
        return;
    };
    let eng = dev.copy_engine().unwrap();
    let dst = dev.alloc(1024).unwrap();
    let copy = |v: u8, offset: usize| {
        let to: Arc<dyn DeviceBuffer> = dst.clone();
        eng.issue(
            CopySrc::Host(Arc::new(vec![v; 256])),
            CopyDst { buffer: to, offset },
            256,
        )
        .unwrap()
    };
    let start = std::time::Instant::now();
    gpu.fail_next_blits(1);
    let bad = copy(1, 0);
    let good = copy(2, 256);
    let e = eng.wait(bad).unwrap_err().to_string();
    assert!(
        e.contains("failed on the blit queue") && e.contains("injected"),
        "{e}"
    );
    // reported at every wait on its token and at wait_all; the copy after it still ran
    assert!(eng.wait(bad).is_err());
    eng.wait(good).unwrap();
    assert!(eng.wait_all().is_err());
    let mut out = vec![0u8; 512];
    dst.read(0, &mut out).unwrap();
    assert!(out[..256].iter().all(|&b| b == 0), "a failed copy wrote");
    assert!(out[256..].iter().all(|&b| b == 2));
    // A failed copy waited for on the device: the submission is released and reports it.
    gpu.hold_blits(true);
    gpu.fail_next_blits(1);
    let bad = copy(3, 512);
    eng.wait_on_device(bad).unwrap();
    assert_eq!(dev.pending_device_waits(), 1);
    let release = release_later(&gpu);
    let e = dev.run(None, &[], &[&dst]).unwrap_err().to_string();
    release.join().unwrap();
    assert!(e.contains("failed on the blit queue"), "{e}");
    // A failed copy the host never waited for does not hang the host access or the drop.
    gpu.fail_next_blits(1);
    copy(4, 768);
    dst.read(768, &mut out[..256]).unwrap();
    drop(eng);
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
}

#[test]
fn overlapping_copies_within_one_buffer_are_refused() {
    let Some(dev) = device() else { return };
    let eng = dev.copy_engine().unwrap();
    let a: Arc<dyn DeviceBuffer> = dev.alloc(1024).unwrap();
    let b: Arc<dyn DeviceBuffer> = dev.alloc(1024).unwrap();
    let ramp: Vec<u8> = (0..=255).collect();
    a.write(0, &ramp).unwrap();
    let within = |src: usize, dst: usize, bytes: usize| {
        eng.issue(
            CopySrc::Device {
                buffer: a.clone(),
                offset: src,
            },
            CopyDst {
                buffer: a.clone(),
                offset: dst,
            },
            bytes,
        )
    };
    for (src, dst) in [(0, 64), (64, 0), (0, 0), (0, 127)] {
        let e = within(src, dst, 128).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
        assert!(e.to_string().contains("overlapping"), "{e}");
    }
    // Adjacent ranges of one buffer, and the same offsets of two buffers, are fine.
    let t = within(0, 128, 128).unwrap();
    let u = eng
        .issue(
            CopySrc::Device {
                buffer: a.clone(),
                offset: 0,
            },
            CopyDst {
                buffer: b.clone(),
                offset: 0,
            },
            256,
        )
        .unwrap();
    eng.wait(t).unwrap();
    eng.wait(u).unwrap();
    let mut out = vec![0u8; 256];
    a.read(0, &mut out).unwrap();
    assert_eq!(&out[..128], &ramp[..128]);
    assert_eq!(&out[128..], &ramp[..128]);
    // The host stand-in refuses one too, rather than hiding it with a memmove.
    let gpu = host::HostGpu::new().unwrap();
    let buf = dev.alloc(256).unwrap();
    let event = crate::gpu::Gpu::new_event(&gpu).unwrap();
    let copy = crate::gpu::BlitCopy {
        src: buf.gpu().clone(),
        src_offset: 0,
        dst: buf.gpu().clone(),
        dst_offset: 8,
        bytes: 16,
    };
    assert!(copy.overlaps());
    assert!(crate::gpu::Gpu::blit(&gpu, copy, &event, 1).is_err());
}

#[test]
fn copy_engine_orders_copies_and_reports_errors() {
    let Some(dev) = device() else { return };
    let eng = dev.copy_engine().unwrap();
    let a: Arc<dyn DeviceBuffer> = dev.alloc(4096).unwrap();
    let b: Arc<dyn DeviceBuffer> = dev.alloc(4096).unwrap();
    // FIFO: later copies overwrite earlier ones into the same bytes, then b <- a.
    let mut last = None;
    for round in 0..20u8 {
        let bytes: Arc<Vec<u8>> = Arc::new(vec![round; 4096]);
        last = Some(
            eng.issue(
                CopySrc::Host(bytes),
                CopyDst {
                    buffer: a.clone(),
                    offset: 0,
                },
                4096,
            )
            .unwrap(),
        );
    }
    let t = eng
        .issue(
            CopySrc::Device {
                buffer: a.clone(),
                offset: 1024,
            },
            CopyDst {
                buffer: b.clone(),
                offset: 0,
            },
            1024,
        )
        .unwrap();
    assert!(t > last.unwrap());
    eng.wait(t).unwrap();
    eng.wait(t).unwrap(); // waiting twice returns at once
    eng.wait(last.unwrap()).unwrap(); // stale token
    let mut out = vec![0u8; 2048];
    b.read(0, &mut out).unwrap();
    assert!(out[..1024].iter().all(|&x| x == 19));
    assert!(out[1024..].iter().all(|&x| x == 0));
    // bounds are checked at issue, and nothing is copied
    let bad = eng.issue(
        CopySrc::Device {
            buffer: a.clone(),
            offset: 4000,
        },
        CopyDst {
            buffer: b.clone(),
            offset: 0,
        },
        200,
    );
    assert!(matches!(bad, Err(Error::Bounds(_))), "{bad:?}");
    // tokens of another engine, or never issued, are errors
    let other = dev.copy_engine().unwrap();
    assert!(other.wait(t).is_err());
    let never = BarrierToken {
        engine: t.engine,
        seq: t.seq + 100,
    };
    assert!(eng.wait(never).is_err());
    eng.wait_all().unwrap();
}

#[test]
fn compute_waits_on_the_device_for_a_copy() {
    let Some(dev) = device() else { return };
    let eng = dev.copy_engine().unwrap();
    let n = 1 << 16;
    let src = dev.alloc(n * 4).unwrap();
    let dst = dev.alloc(n * 4).unwrap();
    put(&src, &data(n, 9));
    let dst_dyn: Arc<dyn DeviceBuffer> = dst.clone();
    let host: Arc<Vec<u8>> = Arc::new(data(n, 7).iter().flat_map(|x| x.to_ne_bytes()).collect());
    let t = eng
        .issue(
            CopySrc::Host(host),
            CopyDst {
                buffer: dst_dyn,
                offset: 0,
            },
            n * 4,
        )
        .unwrap();
    let (event, value) = eng.device_wait(t).unwrap();
    // out = dst + src (a generated fused kernel), ordered after the copy by the event, not by
    // a host wait
    let out = dev.alloc(n * 4).unwrap();
    let add = rlx_ir::Fused {
        shape: rlx_ir::Shape::new([n]),
        n_inputs: 2,
        steps: vec![rlx_ir::FusedStep::Binary(rlx_ir::BinaryOp::Add, 0, 1)],
    };
    let lib = dev
        .compile_cached(&kernels::fused_kernel("add", &add))
        .unwrap();
    let mut p = P::sized(n);
    p.ptr[..3].copy_from_slice(&[
        dst.address(0).unwrap(),
        src.address(0).unwrap(),
        out.address(0).unwrap(),
    ]);
    p.mode[..3].copy_from_slice(&[1, 1, 1]);
    let rec = kernels::record(&p);
    dev.run(
        Some((&event, value)),
        &[Dispatch {
            library: lib.as_ref(),
            kernel: "add",
            record: &rec,
            threads: n,
        }],
        &[&src, &dst, &out],
    )
    .unwrap();
    let want: Vec<f32> = data(n, 7)
        .iter()
        .zip(data(n, 9))
        .map(|(x, y)| x + y)
        .collect();
    close(&get(&out, n), &want, 1e-6);
    eng.wait(t).unwrap();
}

#[test]
fn bad_kernel_source_is_a_device_error() {
    if host::cxx().is_none() {
        eprintln!("skipped: no C++ compiler");
        return;
    }
    let gpu = host::HostGpu::new().unwrap();
    let e = crate::gpu::Gpu::compile(
        &gpu,
        "kernel void broken(constant int& p, uint i) { oops; }",
    )
    .err()
    .expect("compile error");
    assert!(
        matches!(&e, Error::Device(m) if m.contains("does not compile")),
        "{e:?}"
    );
}

#[test]
fn backend_passes_the_copy_engine_conformance_check() {
    let Some(dev) = device() else { return };
    let backend: Arc<dyn rlx_runtime::Backend> =
        Arc::new(crate::MetalBackend::new(dev, rlx_cpu::host_update));
    rlx_runtime::conformance::copy_engine_contract(&backend);
}

#[test]
fn backend_passes_the_compile_checks_conformance() {
    let Some(dev) = device() else { return };
    let backend: Arc<dyn rlx_runtime::Backend> =
        Arc::new(crate::MetalBackend::new(dev, rlx_cpu::host_update));
    rlx_runtime::conformance::compile_rejects_bad_programs(&backend);
}

/// Runs `program` over an arena holding `init` on `backend`, returns the arena's floats.
fn run_on(backend: &dyn rlx_runtime::Backend, program: &Program, init: &[f32]) -> Vec<f32> {
    let arena = backend.alloc(init.len() * 4).unwrap();
    let bytes: Vec<u8> = init.iter().flat_map(|x| x.to_ne_bytes()).collect();
    arena.write(0, &bytes).unwrap();
    let mut compiled = backend.compile(program, &[arena.len()]).unwrap();
    // SAFETY: nothing else touches `arena` while the program runs.
    #[allow(unsafe_code)]
    unsafe { compiled.run(&[arena.as_ref()], None) }.unwrap();
    let mut out = vec![0u8; bytes.len()];
    arena.read(0, &mut out).unwrap();
    out.chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn elementwise_programs_match_the_cpu_backend() {
    use rlx_ir::{BinaryOp as B, DType, Op, Shape, UnaryOp as U};
    let Some(dev) = device() else { return };
    let metal = crate::MetalBackend::new(dev, rlx_cpu::host_update);
    let n = 300;
    let t = |slot: usize| TRef {
        buf: Buf::Arena,
        offset: slot * n * 4,
        shape: Shape::new([n]),
        dtype: DType::F32,
    };
    let op = |op: Op, ins: Vec<TRef>, out: TRef| Instr::Op { op, ins, out };
    // slots 0, 1: inputs; each instruction writes a fresh slot from earlier ones
    let program = Program {
        instrs: vec![
            op(Op::Binary(B::Mul), vec![t(0), t(1)], t(2)),
            op(Op::Unary(U::Tanh), vec![t(2)], t(3)),
            op(Op::Binary(B::Add), vec![t(3), t(0)], t(4)),
            op(Op::Unary(U::Relu), vec![t(4)], t(5)),
            op(Op::Unary(U::Sigmoid), vec![t(1)], t(6)),
            op(Op::Binary(B::Div), vec![t(5), t(6)], t(7)),
            op(Op::Binary(B::Sub), vec![t(7), t(1)], t(8)),
            op(Op::Unary(U::Exp), vec![t(0)], t(9)),
            op(Op::Unary(U::Sqrt), vec![t(9)], t(10)),
            op(Op::Unary(U::Neg), vec![t(10)], t(11)),
            op(Op::Unary(U::Gelu), vec![t(8)], t(12)),
            op(Op::Unary(U::GeluTanhDeriv), vec![t(8)], t(13)),
            op(Op::Unary(U::PowScalar(3.0)), vec![t(8)], t(14)),
            op(Op::Binary(B::FloorDiv), vec![t(8), t(1)], t(15)),
        ],
    };
    let mut init = vec![0f32; 16 * n];
    init[..n].copy_from_slice(&data(n, 11));
    init[n..2 * n].copy_from_slice(&data(n, 12));
    let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
    let got = run_on(&metal, &program, &init);
    assert!(want[2 * n..].iter().any(|&x| x != 0.0));
    close(&got, &want, 1e-5);
}

#[test]
fn attention_beyond_the_kernels_head_size_is_refused_by_name() {
    use rlx_ir::{DType, Op, Shape};
    let Some(dev) = device() else { return };
    let metal = crate::MetalBackend::new(dev, rlx_cpu::host_update);
    let t = |offset: usize| TRef {
        buf: Buf::Arena,
        offset,
        shape: Shape::new([1, 2, 300]),
        dtype: DType::F32,
    };
    let program = Program {
        instrs: vec![Instr::Op {
            op: Op::Attention {
                scale: 1.0,
                causal: None,
                heads: None,
                lowp: None,
            },
            ins: vec![t(0), t(2400), t(4800)],
            out: t(7200),
        }],
    };
    let e = rlx_runtime::Backend::compile(&metal, &program, &[9600])
        .err()
        .expect("refused");
    assert!(
        matches!(&e, Error::Unsupported { op, msg } if op == "attention" && msg.contains("metal")),
        "{e:?}"
    );
}

/// (a dims, b dims, out dims, trans_a, trans_b)
type MatMulCase = (
    &'static [usize],
    &'static [usize],
    &'static [usize],
    bool,
    bool,
);

#[test]
fn matmul_programs_match_the_cpu_backend() {
    use rlx_ir::{DType, Op, Shape};
    let Some(dev) = device() else { return };
    let cases: [MatMulCase; 7] = [
        (&[5, 7], &[7, 6], &[5, 6], false, false),
        (&[7, 5], &[6, 7], &[5, 6], true, true),
        (&[3, 4, 9], &[9, 2], &[3, 4, 2], false, false),
        (&[2, 6, 3], &[2, 5, 6], &[2, 3, 5], true, true),
        (&[4, 3], &[2, 3, 5], &[2, 4, 5], false, false),
        (&[2, 3, 4], &[5, 4], &[2, 3, 5], false, true),
        // numpy batch broadcasting: one GEMM per output matrix, at offsets
        (&[2, 1, 3, 4], &[1, 3, 4, 2], &[2, 3, 3, 2], false, false),
    ];
    // on the MSL kernel, and on the engine (the host runs it from the key alone)
    let policies = [MatmulPolicy::OFF, MatmulPolicy::ALL];
    for ((ad, bd, od, ta, tb), policy) in cases
        .iter()
        .flat_map(|c| policies.iter().map(move |p| (*c, *p)))
    {
        let metal = crate::MetalBackend::with_options(
            dev.clone(),
            rlx_cpu::host_update,
            crate::MetalOptions {
                matmul: policy,
                attention: policy,
                update: crate::UpdateMode::Kernel,
            },
        );
        let (na, nb, no) = (
            ad.iter().product::<usize>(),
            bd.iter().product::<usize>(),
            od.iter().product::<usize>(),
        );
        let r = |offset: usize, dims: &[usize]| TRef {
            buf: Buf::Arena,
            offset: offset * 4,
            shape: Shape::new(dims.to_vec()),
            dtype: DType::F32,
        };
        let program = Program {
            instrs: vec![Instr::Op {
                op: Op::MatMul {
                    trans_a: ta,
                    trans_b: tb,
                },
                ins: vec![r(0, ad), r(na, bd)],
                out: r(na + nb, od),
            }],
        };
        let mut init = data(na + nb, 21);
        init.resize(na + nb + no, 0.0);
        let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
        let got = run_on(&metal, &program, &init);
        assert!(want[na + nb..].iter().any(|&x| x != 0.0));
        close(&got, &want, 1e-4);
    }
}

fn matmul_program(m: usize, k: usize, n: usize) -> (Program, usize) {
    use rlx_ir::{DType, Op, Shape};
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    let program = Program {
        instrs: vec![Instr::Op {
            op: Op::MatMul {
                trans_a: false,
                trans_b: true,
            },
            ins: vec![r(0, &[m, k]), r(m * k, &[n, k])],
            out: r(m * k + n * k, &[m, n]),
        }],
    };
    (program, (m * k + n * k + m * n) * 4)
}

#[test]
fn planned_gemms_are_routed_with_reasons_and_compiled_once_per_key() {
    use crate::matmul::{MatmulKey, MatmulPolicy};
    use crate::program::{MatmulRoute, MetalProgram};
    let Some(dev) = device() else { return };
    let opts = |matmul| crate::MetalOptions {
        matmul,
        attention: matmul,
        update: crate::UpdateMode::Kernel,
    };
    let compile = |m, k, n, policy| {
        let (program, bytes) = matmul_program(m, k, n);
        MetalProgram::new(
            dev.clone(),
            &program,
            &[bytes],
            rlx_cpu::host_update,
            opts(policy),
        )
        .unwrap()
    };
    let before = dev.matmuls_compiled();
    let big = compile(80, 72, 64, MatmulPolicy::default());
    let key = MatmulKey {
        batch: 1,
        a_batch: 1,
        b_batch: 1,
        m: 80,
        n: 64,
        k: 72,
        ta: false,
        tb: true,
        epilogue: Default::default(),
    };
    assert_eq!(big.matmul_routes(), &[(0, MatmulRoute::Engine(key))]);
    assert_eq!(dev.matmuls_compiled(), before + 1);
    // the same shapes at other offsets, in another program: the cached executable
    let again = compile(80, 72, 64, MatmulPolicy::ALL);
    assert_eq!(again.matmul_routes(), big.matmul_routes());
    assert_eq!(dev.matmuls_compiled(), before + 1);
    let small = compile(8, 8, 8, MatmulPolicy::default());
    let [(0, MatmulRoute::Kernel(why))] = small.matmul_routes() else {
        panic!("{:?}", small.matmul_routes())
    };
    assert!(why.contains("below the engine's threshold"), "{why}");
    let off = compile(80, 72, 64, MatmulPolicy::OFF);
    let [(0, MatmulRoute::Kernel(why))] = off.matmul_routes() else {
        panic!("{:?}", off.matmul_routes())
    };
    assert!(why.contains("off"), "{why}");
    assert_eq!(dev.matmuls_compiled(), before + 1);
}

#[test]
fn engine_arrays_past_their_buffer_are_refused() {
    use crate::gpu::{MatmulCall, Work};
    use crate::matmul::MatmulKey;
    let Some(dev) = device() else { return };
    let key = MatmulKey {
        batch: 1,
        a_batch: 1,
        b_batch: 1,
        m: 4,
        n: 4,
        k: 4,
        ta: false,
        tb: false,
        epilogue: Default::default(),
    };
    let exe = dev.matmul(key).unwrap();
    let buf = dev.alloc(64 * 3).unwrap();
    let call = |c_off| {
        Work::Matmul(MatmulCall {
            exe: exe.as_ref(),
            a: (buf.gpu(), 0),
            b: (buf.gpu(), 64),
            c: (buf.gpu(), c_off),
            bias: None,
        })
    };
    dev.run_work(None, &[call(128)], &[&buf]).unwrap();
    let e = dev.run_work(None, &[call(132)], &[&buf]).unwrap_err();
    assert!(e.to_string().contains("past a buffer of 192"), "{e}");
}

#[test]
fn fused_programs_with_broadcast_operands_match_the_cpu_backend() {
    use rlx_ir::{BinaryOp as B, DType, Fused, FusedStep as S, Op, Shape, UnaryOp as U};
    let Some(dev) = device() else { return };
    let metal = crate::MetalBackend::new(dev, rlx_cpu::host_update);
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    // out[4, 6, 5] from a [4, 6, 5], b [6, 1] (strided broadcast) and a scalar c
    let f = Fused {
        shape: Shape::new([4, 6, 5]),
        n_inputs: 3,
        steps: vec![
            S::Binary(B::Mul, 0, 1),         // r3 = a * b
            S::Unary(U::GeluTanh, 3),        // r4
            S::Binary(B::Gt, 0, 2),          // r5 = a > c
            S::Binary(B::FloorDiv, 4, 1),    // r6 = r4 // b
            S::Where(5, 6, 3),               // r7 = a > c ? r6 : r3
            S::Unary(U::PowScalar(-2.5), 1), // r8 = b^-2.5 (NaN for b < 0)
            S::Binary(B::Mod, 7, 8),         // r9 = r7 mod r8
            S::Binary(B::Add, 9, 0),         // r10
        ],
    };
    let (na, nb) = (120, 6);
    let program = Program {
        instrs: vec![Instr::Op {
            op: Op::Fused(Arc::new(f)),
            ins: vec![r(0, &[4, 6, 5]), r(na, &[6, 1]), r(na + nb, &[])],
            out: r(na + nb + 1, &[4, 6, 5]),
        }],
    };
    let mut init = data(na + nb + 1, 31);
    init.resize(2 * na + nb + 1, 0.0);
    let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
    let got = run_on(&metal, &program, &init);
    assert!(want[na + nb + 1..]
        .iter()
        .any(|x| x.is_finite() && *x != 0.0));
    assert!(want[na + nb + 1..].iter().any(|x| x.is_nan()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "element {i}: metal {g}, cpu {w}"
        );
    }
}

#[test]
fn update_mode_from_the_environment_value() {
    use crate::UpdateMode;
    assert_eq!(UpdateMode::parse(None).unwrap(), UpdateMode::Kernel);
    assert_eq!(UpdateMode::parse(Some("")).unwrap(), UpdateMode::Kernel);
    assert_eq!(
        UpdateMode::parse(Some("kernel")).unwrap(),
        UpdateMode::Kernel
    );
    assert_eq!(UpdateMode::parse(Some(" host")).unwrap(), UpdateMode::Host);
    let e = UpdateMode::parse(Some("gpu")).unwrap_err();
    assert!(matches!(e, Error::Input { .. }), "{e}");
    assert!(e.to_string().contains("RLX_METAL_UPDATE"), "{e}");
    assert!(e.to_string().contains("\"gpu\""), "{e}");
}

#[test]
fn the_update_kernels_thread_counts_follow_their_records() {
    let mut p = P::sized(2049);
    assert_eq!(kernels::threads("rlx_sumsq", &p).unwrap(), 3);
    p.iv[2] = 5; // chunks of the update table
    assert_eq!(
        kernels::threads("rlx_update_multi", &p).unwrap(),
        5 * kernels::UPDATE_LANES
    );
    assert_eq!(kernels::threads("rlx_update_ctrl", &p).unwrap(), 1);
    assert_eq!(kernels::threads("rlx_update_finish", &p).unwrap(), 1);
    assert_eq!(kernels::threads("rlx_accumulate", &p).unwrap(), 2049);
    // the MSL source's constants are the ones the thread counts assume
    let chunk = format!("#define RX_SUMSQ_CHUNK {}", kernels::SUMSQ_CHUNK);
    let lanes = format!("#define RX_UPDATE_LANES {}", kernels::UPDATE_LANES);
    assert!(kernels::LIBRARY.contains(&chunk) && kernels::LIBRARY.contains(&lanes));
}

#[test]
fn matmul_epilogues_run_on_the_engine_where_they_are_bias_and_activation() {
    use crate::matmul::{Activation, Epilogue};
    use crate::program::{MatmulRoute, MetalProgram};
    use rlx_ir::{BinaryOp as B, DType, Fused, FusedStep as S, Op, Shape, UnaryOp as U};
    let Some(dev) = device() else { return };
    let (m, k, n) = (6, 5, 7);
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    let shape = Shape::new([m, n]);
    let epi = |n_inputs: usize, steps: Vec<S>| Fused {
        shape: shape.clone(),
        n_inputs,
        steps,
    };
    // (epilogue, its second input's dims, the engine's epilogue or None: stays a kernel)
    let cases: Vec<(Fused, Option<Vec<usize>>, Option<Epilogue>)> = vec![
        (
            epi(2, vec![S::Binary(B::Add, 0, 1), S::Unary(U::Relu, 2)]),
            Some(vec![n]),
            Some(Epilogue {
                bias: true,
                act: Some(Activation::Relu),
            }),
        ),
        (
            epi(2, vec![S::Binary(B::Add, 1, 0), S::Unary(U::Tanh, 2)]),
            Some(vec![1, n]),
            Some(Epilogue {
                bias: true,
                act: Some(Activation::Tanh),
            }),
        ),
        (
            epi(2, vec![S::Binary(B::Add, 0, 1)]),
            Some(vec![n]),
            Some(Epilogue {
                bias: true,
                act: None,
            }),
        ),
        (
            epi(1, vec![S::Unary(U::Sigmoid, 0)]),
            None,
            Some(Epilogue {
                bias: false,
                act: Some(Activation::Sigmoid),
            }),
        ),
        // a residual add (a whole matrix, not a vector per row): the epilogue stays a kernel
        (
            epi(2, vec![S::Binary(B::Add, 0, 1)]),
            Some(vec![m, n]),
            None,
        ),
        // a per-row (column) bias: likewise
        (
            epi(2, vec![S::Binary(B::Add, 0, 1)]),
            Some(vec![m, 1]),
            None,
        ),
        // another expression
        (
            epi(2, vec![S::Binary(B::Mul, 0, 1), S::Unary(U::Relu, 2)]),
            Some(vec![n]),
            None,
        ),
    ];
    for (f, extra, want) in cases {
        let (na, nb) = (m * k, k * n);
        let ne = extra.as_ref().map_or(0, |d| d.iter().product::<usize>());
        let mut ins = vec![r(0, &[m, k]), r(na, &[k, n])];
        if let Some(d) = &extra {
            ins.push(r(na + nb, d));
        }
        let what = format!("{f}");
        let program = Program {
            instrs: vec![Instr::Op {
                op: Op::MatMulEpilogue {
                    trans_a: false,
                    trans_b: false,
                    epilogue: Arc::new(f),
                },
                ins,
                out: r(na + nb + ne, &[m, n]),
            }],
        };
        let total = na + nb + ne + m * n;
        let opts = crate::MetalOptions {
            matmul: MatmulPolicy::ALL,
            attention: MatmulPolicy::ALL,
            update: crate::UpdateMode::Kernel,
        };
        let prog = MetalProgram::new(
            dev.clone(),
            &program,
            &[total * 4],
            rlx_cpu::host_update,
            opts,
        )
        .unwrap();
        let routes = prog.matmul_routes();
        let MatmulRoute::Engine(key) = &routes[0].1 else {
            panic!("{what}: {routes:?}")
        };
        match want {
            Some(e) => {
                assert_eq!(key.epilogue, e, "{what}");
                assert_eq!(routes.len(), 1, "{what}: {routes:?}");
            }
            None => {
                assert!(key.epilogue.is_none(), "{what}");
                assert!(
                    matches!(&routes[1], (1, MatmulRoute::EpilogueKernel(_))),
                    "{what}: {routes:?}"
                );
            }
        }
        let metal = crate::MetalBackend::with_options(dev.clone(), rlx_cpu::host_update, opts);
        let mut init = data(na + nb + ne, 33);
        init.resize(total, 0.0);
        let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
        let got = run_on(&metal, &program, &init);
        assert!(want[na + nb + ne..].iter().any(|&x| x != 0.0), "{what}");
        close(&got, &want, 1e-5);
    }
}

/// An attention forward over head-major `[b, h, l, e]` / `[b, h, s, e]` tensors in the arena
/// (q, k, v, then out), and the arena's size in floats.
fn attention_program(
    [b, h, l, s, e]: [usize; 5],
    causal: Option<i64>,
    heads: Option<usize>,
) -> (Program, usize) {
    use rlx_ir::{DType, Op, Shape};
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    let (nq, nk) = (b * h * l * e, b * h * s * e);
    let op = Op::Attention {
        scale: 1.0 / (e as f32).sqrt(),
        causal,
        heads,
        lowp: None,
    };
    let instr = match heads {
        None => Instr::Op {
            op,
            ins: vec![
                r(0, &[b, h, l, e]),
                r(nq, &[b, h, s, e]),
                r(nq + nk, &[b, h, s, e]),
            ],
            out: r(nq + 2 * nk, &[b, h, l, e]),
        },
        // packed qkv (b, l, 3 h e); out (b, l, h e)
        Some(hh) => Instr::Op {
            op,
            ins: vec![r(0, &[b, l, 3 * hh * e])],
            out: r(3 * b * l * hh * e, &[b, l, hh * e]),
        },
    };
    (
        Program {
            instrs: vec![instr],
        },
        nq + 2 * nk + nq,
    )
}

#[test]
fn attention_runs_on_the_engine_where_routed_and_matches_the_cpu_backend() {
    use crate::attention::AttentionKey;
    use crate::program::{AttentionRoute, MetalProgram};
    let Some(dev) = device() else { return };
    let dims = [2, 3, 16, 24, 8];
    let before = dev.attentions_compiled();
    for causal in [None, Some(0), Some(3)] {
        let (program, floats) = attention_program(dims, causal, None);
        let init = data(floats, 31);
        let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
        for policy in [MatmulPolicy::ALL, MatmulPolicy::OFF] {
            let opts = crate::MetalOptions {
                matmul: MatmulPolicy::OFF,
                attention: policy,
                update: crate::UpdateMode::Kernel,
            };
            let prog = MetalProgram::new(
                dev.clone(),
                &program,
                &[floats * 4],
                rlx_cpu::host_update,
                opts,
            )
            .unwrap();
            let key = AttentionKey {
                bh: 6,
                l: 16,
                s: 24,
                e: 8,
                ev: 8,
                scale_bits: (1.0 / 8f32.sqrt()).to_bits(),
                causal,
                grad: false,
                heads: None,
            };
            match (policy.enabled, prog.attention_routes()) {
                (true, [(0, AttentionRoute::Engine(k))]) => assert_eq!(*k, key),
                (false, [(0, AttentionRoute::Kernel(why))]) => {
                    assert!(why.contains("off"), "{why}")
                }
                (_, r) => panic!("{policy:?}: {r:?}"),
            }
            let metal = crate::MetalBackend::with_options(dev.clone(), rlx_cpu::host_update, opts);
            let got = run_on(&metal, &program, &init);
            let out = floats - 6 * 16 * 8;
            assert!(want[out..].iter().any(|&x| x != 0.0));
            close(&got, &want, 1e-4);
        }
    }
    // one executable per key, whatever the program
    assert_eq!(dev.attentions_compiled(), before + 3);
    // below the threshold and with a negative causal offset it stays on the kernel, with why
    let kernel_why = |program: &Program, floats: usize, policy| {
        let opts = crate::MetalOptions {
            matmul: MatmulPolicy::OFF,
            attention: policy,
            update: crate::UpdateMode::Kernel,
        };
        let prog = MetalProgram::new(
            dev.clone(),
            program,
            &[floats * 4],
            rlx_cpu::host_update,
            opts,
        )
        .unwrap();
        match prog.attention_routes() {
            [(0, AttentionRoute::Kernel(why))] => why.clone(),
            r => panic!("{r:?}"),
        }
    };
    let (small, n) = attention_program([1, 1, 4, 4, 4], None, None);
    assert!(kernel_why(&small, n, MatmulPolicy::default()).contains("threshold"));
    let (blind, n) = attention_program([1, 2, 8, 8, 4], Some(-1), None);
    assert!(kernel_why(&blind, n, MatmulPolicy::ALL).contains("causal offset"));
}

#[test]
fn attention_gradient_runs_on_the_engine_where_routed_and_matches_the_cpu_backend() {
    use crate::program::{AttentionRoute, MetalProgram};
    use rlx_ir::{DType, Op, Shape};
    let Some(dev) = device() else { return };
    let (b, h, l, s, e) = (2, 3, 16, 24, 8);
    let (nq, nk) = (b * h * l * e, b * h * s * e);
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    for causal in [None, Some(0), Some(5)] {
        // inputs q, k, v, out (the forward result), g; the gradient [dq | dk | dv] after them
        let fwd = r(nq + 2 * nk, &[b, h, l, e]);
        let grad_at = 2 * nq + 2 * nk + nq;
        let program = Program {
            instrs: vec![
                Instr::Op {
                    op: Op::Attention {
                        scale: 0.3,
                        causal,
                        heads: None,
                        lowp: None,
                    },
                    ins: vec![
                        r(0, &[b, h, l, e]),
                        r(nq, &[b, h, s, e]),
                        r(nq + nk, &[b, h, s, e]),
                    ],
                    out: fwd.clone(),
                },
                Instr::Op {
                    op: Op::AttentionGrad {
                        scale: 0.3,
                        causal,
                        heads: None,
                        lowp: None,
                    },
                    ins: vec![
                        r(0, &[b, h, l, e]),
                        r(nq, &[b, h, s, e]),
                        r(nq + nk, &[b, h, s, e]),
                        fwd.clone(),
                        r(2 * nq + 2 * nk, &[b, h, l, e]),
                    ],
                    out: r(grad_at, &[nq + 2 * nk]),
                },
            ],
        };
        let floats = grad_at + nq + 2 * nk;
        let init = data(floats, 41);
        // The outputs start dirty (random data): every byte of them must be written.
        let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
        for policy in [MatmulPolicy::ALL, MatmulPolicy::OFF] {
            let opts = crate::MetalOptions {
                matmul: MatmulPolicy::OFF,
                attention: policy,
                update: crate::UpdateMode::Kernel,
            };
            let prog = MetalProgram::new(
                dev.clone(),
                &program,
                &[floats * 4],
                rlx_cpu::host_update,
                opts,
            )
            .unwrap();
            let routes = prog.attention_routes();
            assert_eq!(routes.len(), 2, "{routes:?}");
            for (_, route) in routes {
                match (policy.enabled, route) {
                    (true, AttentionRoute::Engine(_)) | (false, AttentionRoute::Kernel(_)) => {}
                    _ => panic!("{policy:?}: {routes:?}"),
                }
            }
            if let (_, AttentionRoute::Engine(k)) = &routes[1] {
                assert!(k.grad && k.causal == causal);
            }
            let metal = crate::MetalBackend::with_options(dev.clone(), rlx_cpu::host_update, opts);
            let got = run_on(&metal, &program, &init);
            assert!(want[grad_at..].iter().any(|&x| x != 0.0));
            close(&got, &want, 1e-4);
        }
    }
}

#[test]
fn packed_qkv_attention_runs_on_the_engine_and_matches_the_cpu_backend() {
    use crate::program::{AttentionRoute, MetalProgram};
    use rlx_ir::{DType, Op, Shape};
    let Some(dev) = device() else { return };
    let (b, t, h, e) = (2, 12, 3, 8);
    let (nqkv, no) = (b * t * 3 * h * e, b * t * h * e);
    let r = |offset: usize, dims: &[usize]| TRef {
        buf: Buf::Arena,
        offset: offset * 4,
        shape: Shape::new(dims.to_vec()),
        dtype: DType::F32,
    };
    for causal in [None, Some(0), Some(2)] {
        // qkv, out (forward), g, then d qkv
        let (qkv, out, g, dqkv) = (
            r(0, &[b, t, 3 * h * e]),
            r(nqkv, &[b, t, h * e]),
            r(nqkv + no, &[b, t, h * e]),
            r(nqkv + 2 * no, &[b, t, 3 * h * e]),
        );
        let att = |grad: bool| {
            let (scale, heads, lowp) = (0.4, Some(h), None);
            if grad {
                Op::AttentionGrad {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            } else {
                Op::Attention {
                    scale,
                    causal,
                    heads,
                    lowp,
                }
            }
        };
        let program = Program {
            instrs: vec![
                Instr::Op {
                    op: att(false),
                    ins: vec![qkv.clone()],
                    out: out.clone(),
                },
                Instr::Op {
                    op: att(true),
                    ins: vec![qkv.clone(), out.clone(), g.clone()],
                    out: dqkv.clone(),
                },
            ],
        };
        let floats = 2 * nqkv + 2 * no;
        let init = data(floats, 53);
        let want = run_on(&rlx_cpu::CpuBackend, &program, &init);
        assert!(want[nqkv + 2 * no..].iter().any(|&x| x != 0.0));
        for policy in [MatmulPolicy::ALL, MatmulPolicy::OFF] {
            let opts = crate::MetalOptions {
                matmul: MatmulPolicy::OFF,
                attention: policy,
                update: crate::UpdateMode::Kernel,
            };
            let prog = MetalProgram::new(
                dev.clone(),
                &program,
                &[floats * 4],
                rlx_cpu::host_update,
                opts,
            )
            .unwrap();
            let routes = prog.attention_routes();
            assert_eq!(routes.len(), 2, "{routes:?}");
            for (_, route) in routes {
                match (policy.enabled, route) {
                    (true, AttentionRoute::Engine(k)) => {
                        assert_eq!((k.heads, k.bh, k.l, k.causal), (Some(h), b * h, t, causal))
                    }
                    (false, AttentionRoute::Kernel(_)) => {}
                    _ => panic!("{policy:?}: {routes:?}"),
                }
            }
            let metal = crate::MetalBackend::with_options(dev.clone(), rlx_cpu::host_update, opts);
            close(&run_on(&metal, &program, &init), &want, 1e-4);
        }
    }
}
