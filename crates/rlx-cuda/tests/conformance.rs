//! The backend conformance suite on the first GPU; each test prints SKIPPED with the reason where
//! CUDA is unavailable (no driver, no GPU, a library missing).
rlx_runtime::conformance_tests!(skip_unless: rlx_cuda::CudaBackend::new(0)
    .map(|b| std::sync::Arc::new(b) as std::sync::Arc<dyn rlx_runtime::Backend>)
    .map_err(|e| e.to_string()));

#[test]
fn unavailable_cuda_is_a_clear_device_error() {
    match rlx_cuda::available() {
        Ok(n) => assert!(n > 0),
        Err(why) => {
            let e = rlx_cuda::CudaBackend::new(0)
                .err()
                .expect("no backend without CUDA");
            let msg = e.to_string();
            assert!(msg.contains(&why), "{msg} vs {why}");
            assert!(matches!(e, rlx_ir::Error::Device(_)), "{e:?}");
        }
    }
}

/// A one-rank NCCL communicator on the first GPU: the all-reduce mean and the broadcast leave
/// the data as it is, and bad requests are clear errors. (Several ranks need several GPUs.)
#[test]
fn nccl_one_rank_collectives() {
    use rlx_runtime::Backend;
    let backend = match rlx_cuda::CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => return eprintln!("SKIPPED nccl_one_rank_collectives: {e}"),
    };
    if let Err(why) = rlx_cuda::nccl::available() {
        return eprintln!("SKIPPED nccl_one_rank_collectives: {why}");
    }
    let id = rlx_cuda::nccl::unique_id().unwrap();
    let t = std::time::Duration::from_secs(30);
    let bad = rlx_cuda::nccl::Comm::new(0, &id[..64], 1, 0, t)
        .err()
        .unwrap();
    assert!(bad.to_string().contains("128-byte unique id"), "{bad}");
    let bad = rlx_cuda::nccl::Comm::new(0, &id, 1, 1, t).err().unwrap();
    assert!(bad.to_string().contains("rank 1, size 1"), "{bad}");
    let comm = rlx_cuda::nccl::Comm::new(0, &id, 1, 0, t).unwrap();
    let buf = backend.alloc(1024).unwrap();
    let data: Vec<u8> = (0..256u32)
        .flat_map(|i| (i as f32 * 0.5 - 3.0).to_le_bytes())
        .collect();
    buf.write(0, &data).unwrap();
    comm.all_reduce_mean(buf.as_ref(), 64, 512).unwrap();
    comm.broadcast(buf.as_ref(), 0, 1024, 0).unwrap();
    let mut back = vec![0u8; 1024];
    buf.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    let e = comm.broadcast(buf.as_ref(), 0, 1024, 1).unwrap_err();
    assert!(e.to_string().contains("root 1 of 1 ranks"), "{e}");
    let e = comm.all_reduce_mean(buf.as_ref(), 2, 8).unwrap_err();
    assert!(e.to_string().contains("whole float32 elements"), "{e}");
    let e = comm.all_reduce_mean(buf.as_ref(), 1020, 8).unwrap_err();
    assert!(
        matches!(e, rlx_ir::Error::Bounds(_) | rlx_ir::Error::Input { .. }),
        "{e}"
    );
    let host = rlx_cpu::CpuBackend.alloc(64).unwrap();
    let e = comm.all_reduce_mean(host.as_ref(), 0, 64).unwrap_err();
    assert!(e.to_string().contains("GPU memory"), "{e}");
}
