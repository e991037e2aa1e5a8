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
