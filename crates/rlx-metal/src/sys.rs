//! The Apple-facing part of the Metal backend: `crate::gpu::Gpu` on a Metal device (objc2-metal,
//! objc2-metal-performance-shaders(-graph)). Shared-storage buffers (`contents` is the zero-copy
//! host view, `gpuAddress` goes into launch records), a library compiled from MSL source with
//! one pipeline per kernel, engine matmuls (with their bias / activation epilogue) compiled to
//! `MPSGraphExecutable`s whose feeds and results are `MPSNDArray`s over the shared buffers at
//! their byte offsets, one compute queue
//! (each submission one `MPSCommandBuffer`: runs of dispatches in a compute encoder with
//! `setBytes` for the record and `useResource:usage:` for residency, engine matmuls encoded
//! between them with no encoder open, after one `encodeWaitForEvent` per device-side wait), and a separate
//! blit queue whose copies signal an `MTLSharedEvent`. An engine encode may commit and continue
//! the command buffer: encoders are always made after it from the current one, and every
//! command buffer the submission went through is waited on and checked
//! (`crate::matmul::CommandBuffers`). Nothing above this module touches Metal.
//!
//! Type-checked for aarch64-apple-darwin in CI; it has not run on Apple hardware.
#![allow(unsafe_code)] // FFI module: Objective-C objects and raw record bytes
use crate::attention::AttentionKey;
use crate::caps::Capabilities;
use crate::gpu::{
    BlitCopy, Dispatch, EventWait, Gpu, GpuAttention, GpuBuffer, GpuEvent, GpuLibrary, GpuMatmul,
    Submitted, Work,
};
use crate::host::kernel_names;
use crate::matmul::{segments, Activation, CommandBuffers, MatmulKey, Segment};
use objc2::rc::Retained;
use objc2::runtime::{AnyClass, ProtocolObject};
use objc2::{sel, AnyThread};
use objc2_foundation::{NSArray, NSDictionary, NSError, NSNumber, NSString};
use objc2_metal::{
    MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLCompileOptions, MTLComputeCommandEncoder, MTLComputePipelineState,
    MTLCreateSystemDefaultDevice, MTLDevice, MTLGPUFamily, MTLLibrary, MTLResourceOptions,
    MTLResourceUsage, MTLSharedEvent, MTLSize,
};
use objc2_metal_performance_shaders::{
    MPSCommandBuffer, MPSDataType, MPSNDArray, MPSNDArrayDescriptor,
};
use objc2_metal_performance_shaders_graph::{
    MPSGraph, MPSGraphDevice, MPSGraphExecutable, MPSGraphShapedType, MPSGraphTensor,
    MPSGraphTensorData,
};
use rlx_ir::{Error, Result};
use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

fn ns_error(what: &str, e: &NSError) -> Error {
    Error::Device(format!("Metal: {what}: {}", e.localizedDescription()))
}

fn missing(what: &str) -> Error {
    Error::Device(format!("Metal: {what} returned nil"))
}

/// A shared-storage `MTLBuffer`.
pub struct SysBuffer {
    buf: Retained<ProtocolObject<dyn MTLBuffer>>,
    len: usize,
}

// SAFETY: Apple documents MTLBuffer as thread-safe to reference from any thread; access to its
// bytes follows the runtime's contract (one user at a time), not this type.
unsafe impl Send for SysBuffer {}
// SAFETY: as above.
unsafe impl Sync for SysBuffer {}

impl GpuBuffer for SysBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn contents(&self) -> NonNull<u8> {
        self.buf.contents().cast::<u8>()
    }
    fn gpu_address(&self) -> u64 {
        self.buf.gpuAddress()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An `MTLSharedEvent`.
pub struct SysEvent {
    ev: Retained<ProtocolObject<dyn MTLSharedEvent>>,
}

// SAFETY: shared events are designed to be signalled and waited on from any thread and queue.
unsafe impl Send for SysEvent {}
// SAFETY: as above.
unsafe impl Sync for SysEvent {}

impl GpuEvent for SysEvent {
    fn signaled_value(&self) -> u64 {
        self.ev.signaledValue()
    }
    fn wait_until(&self, value: u64, timeout_ms: u64) -> bool {
        self.ev.waitUntilSignaledValue_timeoutMS(value, timeout_ms)
    }
    fn signal(&self, value: u64) {
        // Called once every copy up to `value` is over, when the event has not reached it (a
        // failed copy's signal never comes). A later copy's signal landing between the read
        // and the write is lowered here; `Engine::progress` raises the event again for any
        // wait on that later copy, once it is over.
        if self.ev.signaledValue() < value {
            self.ev.setSignaledValue(value);
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A library and one compute pipeline per kernel, built once.
pub struct SysLibrary {
    pipelines: HashMap<String, Retained<ProtocolObject<dyn MTLComputePipelineState>>>,
}

// SAFETY: MTLComputePipelineState objects are immutable and documented as thread-safe.
unsafe impl Send for SysLibrary {}
// SAFETY: as above.
unsafe impl Sync for SysLibrary {}

impl GpuLibrary for SysLibrary {
    fn has(&self, kernel: &str) -> bool {
        self.pipelines.contains_key(kernel)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The command buffers of one submission (several where an engine encode committed and
/// continued), oldest first, and the buffers they must keep alive until they completed.
struct SysSubmitted {
    cbs: Vec<Retained<ProtocolObject<dyn MTLCommandBuffer>>>,
    _keep: Vec<Arc<dyn GpuBuffer>>,
}

// SAFETY: after commit the command buffers are only queried (wait, status, error), which Metal
// allows from any thread.
unsafe impl Send for SysSubmitted {}
// SAFETY: as above.
unsafe impl Sync for SysSubmitted {}

fn cb_error(cb: &ProtocolObject<dyn MTLCommandBuffer>) -> Error {
    match cb.error() {
        Some(e) => ns_error("command buffer failed", &e),
        None => Error::Device("Metal: command buffer failed".into()),
    }
}

impl Submitted for SysSubmitted {
    fn finish(&self) -> Result<()> {
        // They complete in commit order on one queue; each is checked for its own error.
        for cb in &self.cbs {
            cb.waitUntilCompleted();
            if cb.status() == MTLCommandBufferStatus::Error {
                return Err(cb_error(cb));
            }
        }
        Ok(())
    }
    fn poll(&self) -> Option<Result<()>> {
        for cb in &self.cbs {
            match cb.status() {
                MTLCommandBufferStatus::Completed => {}
                MTLCommandBufferStatus::Error => return Some(Err(cb_error(cb))),
                _ => return None,
            }
        }
        Some(Ok(()))
    }
}

/// A command buffer compared by identity (which object, not its contents).
struct CbRef(Retained<ProtocolObject<dyn MTLCommandBuffer>>);

impl PartialEq for CbRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(Retained::as_ptr(&self.0), Retained::as_ptr(&other.0))
    }
}

/// `[dims...]` as the `NSArray<NSNumber>` shape MPS takes (slowest dimension first).
fn ns_shape(dims: &[usize]) -> Retained<NSArray<NSNumber>> {
    let nums: Vec<Retained<NSNumber>> = dims.iter().map(|&d| NSNumber::new_u64(d as u64)).collect();
    NSArray::from_retained_slice(&nums)
}

/// An engine matmul: an `MPSGraphExecutable` computing `C = act(op(A) op(B) + bias)` for one
/// key, and the order of its feeds.
pub struct SysMatmul {
    key: MatmulKey,
    exe: Retained<MPSGraphExecutable>,
    /// For each feed of the executable, in its order, which array: 0 A, 1 B, 2 the bias.
    order: Vec<usize>,
    /// One encode at a time per executable (MPSGraph objects are not documented thread-safe).
    encoding: Mutex<()>,
}

// SAFETY: the executable is only used under `encoding`'s lock.
unsafe impl Send for SysMatmul {}
// SAFETY: as above.
unsafe impl Sync for SysMatmul {}

impl GpuMatmul for SysMatmul {
    fn key(&self) -> MatmulKey {
        self.key
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A float32 `MPSGraphTensorData` over `bytes` of `buf` from `offset`, shaped `shape`.
fn tensor_data(
    buf: &SysBuffer,
    offset: usize,
    shape: &[usize],
) -> Result<Retained<MPSGraphTensorData>> {
    let bytes = shape.iter().product::<usize>() * 4;
    if offset.checked_add(bytes).is_none_or(|end| end > buf.len) {
        return Err(Error::Internal(format!(
            "engine array of {bytes} bytes at {offset} past a buffer of {}",
            buf.len
        )));
    }
    // SAFETY: a float32 descriptor of the given shape; the array aliases `bytes` bytes of the
    // shared buffer from `offset` (checked above), which the submission keeps alive until it
    // completed; the bytes are float32 values of the arena.
    unsafe {
        let desc = MPSNDArrayDescriptor::descriptorWithDataType_shape(
            MPSDataType::Float32,
            &ns_shape(shape),
        );
        let nd = MPSNDArray::initWithBuffer_offset_descriptor(
            MPSNDArray::alloc(),
            &buf.buf,
            offset,
            &desc,
        );
        Ok(MPSGraphTensorData::initWithMPSNDArray(
            MPSGraphTensorData::alloc(),
            &nd,
        ))
    }
}

/// An engine attention: an `MPSGraphExecutable` computing `softmax(scale q k^T + mask) v`
/// (or its gradient) for one key, and the order of its feeds and results.
pub struct SysAttention {
    key: AttentionKey,
    exe: Retained<MPSGraphExecutable>,
    /// For each feed of the executable, in its order, which array of the call.
    order: Vec<usize>,
    /// For each result of the executable, in its order, which result of the call.
    result_order: Vec<usize>,
    /// One encode at a time per executable (as `SysMatmul`).
    encoding: Mutex<()>,
}

// SAFETY: the executable is only used under `encoding`'s lock.
unsafe impl Send for SysAttention {}
// SAFETY: as above.
unsafe impl Sync for SysAttention {}

impl GpuAttention for SysAttention {
    fn key(&self) -> AttentionKey {
        self.key
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Encodes `exe` (feeds in `order`, by index into `arrays`; results in `result_order`, by
/// index into `results`) on `mps`, and follows the command buffer the encode may have committed
/// and continued to.
fn encode_exe(
    mps: &MPSCommandBuffer,
    cbs: &mut CommandBuffers<CbRef>,
    (exe, order, encoding): (&MPSGraphExecutable, &[usize], &Mutex<()>),
    arrays: &[Retained<MPSGraphTensorData>],
    (results, result_order): (&[Retained<MPSGraphTensorData>], &[usize]),
) {
    let inputs: Vec<Retained<MPSGraphTensorData>> =
        order.iter().map(|&w| arrays[w].clone()).collect();
    let outputs: Vec<Retained<MPSGraphTensorData>> =
        result_order.iter().map(|&w| results[w].clone()).collect();
    let _one = encoding.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the arrays alias live shared buffers (kept alive by the submission) with the
    // shapes the executable was compiled for; no compute encoder is open on the command buffer.
    unsafe {
        exe.encodeToCommandBuffer_inputsArray_resultsArray_executionDescriptor(
            mps,
            &NSArray::from_retained_slice(&inputs),
            Some(&NSArray::from_retained_slice(&outputs)),
            None,
        );
    }
    // The encode may have committed and continued: follow the current buffer.
    // SAFETY: reading the wrapper's current underlying command buffer.
    cbs.observe(CbRef(unsafe { mps.rootCommandBuffer() }));
}

/// A Metal device with its compute queue and its blit (copy) queue.
pub struct MetalGpu {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    compute: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    blit: Retained<ProtocolObject<dyn MTLCommandQueue>>,
}

impl MetalGpu {
    /// The system's default Metal device; a `Device` error where there is none, or where it
    /// lacks what the backend needs (`crate::caps`: Metal 3, macOS 13, unified memory).
    pub fn system_default() -> Result<Self> {
        let device = MTLCreateSystemDefaultDevice()
            .ok_or_else(|| Error::Device("this Mac has no Metal device".into()))?;
        // Asked before anything that needs them: `supportsFamily:` exists since macOS 10.15 and
        // answers no for a family the system does not know; the class check is the runtime's.
        let caps = Capabilities {
            metal3: device.supportsFamily(MTLGPUFamily::Metal3),
            ndarray_at_offset: AnyClass::get(c"MPSNDArray")
                .is_some_and(|c| c.responds_to(sel!(initWithBuffer:offset:descriptor:))),
            unified_memory: device.hasUnifiedMemory(),
        };
        crate::caps::check(&device.name().to_string(), caps)?;
        let compute = device
            .newCommandQueue()
            .ok_or_else(|| missing("newCommandQueue"))?;
        let blit = device
            .newCommandQueue()
            .ok_or_else(|| missing("newCommandQueue"))?;
        Ok(Self {
            device,
            compute,
            blit,
        })
    }
}

impl MetalGpu {
    /// Compiles `graph` for this device with `placeholders` (tensor, shape) as float32 feeds and
    /// `results` as its targets; returns the executable and, for each of its feeds in order,
    /// the index of the placeholder it is, and for each of its results in order, the index of
    /// the target it is.
    ///
    /// # Safety
    /// The tensors are of `graph`.
    unsafe fn compile_graph(
        &self,
        graph: &MPSGraph,
        placeholders: &[(Retained<MPSGraphTensor>, Vec<usize>)],
        results: &[&MPSGraphTensor],
        what: &str,
    ) -> Result<(Retained<MPSGraphExecutable>, Vec<usize>, Vec<usize>)> {
        let types: Vec<Retained<MPSGraphShapedType>> = placeholders
            .iter()
            .map(|(_, s)| {
                MPSGraphShapedType::initWithShape_dataType(
                    MPSGraphShapedType::alloc(),
                    Some(&ns_shape(s)),
                    MPSDataType::Float32,
                )
            })
            .collect();
        let keys: Vec<&MPSGraphTensor> = placeholders.iter().map(|(t, _)| &**t).collect();
        let values: Vec<&MPSGraphShapedType> = types.iter().map(|t| &**t).collect();
        let feeds = NSDictionary::from_slices(&keys, &values);
        let gdev = MPSGraphDevice::deviceWithMTLDevice(&self.device);
        // SAFETY: the caller's tensors are of `graph`; compile blocks until it is built.
        let exe = unsafe {
            graph.compileWithDevice_feeds_targetTensors_targetOperations_compilationDescriptor(
                Some(&gdev),
                &feeds,
                &NSArray::from_slice(results),
                None,
                None,
            )
        };
        // SAFETY: reading the built executable's feeds.
        let fed = unsafe { exe.feedTensors() }
            .ok_or_else(|| missing("MPSGraphExecutable feedTensors"))?;
        let mut order = Vec::with_capacity(placeholders.len());
        for i in 0..fed.count() {
            let t = fed.objectAtIndex(i);
            let which = placeholders
                .iter()
                .position(|(p, _)| std::ptr::eq(Retained::as_ptr(p), Retained::as_ptr(&t)))
                .ok_or_else(|| {
                    Error::Device(format!(
                        "Metal: a {what} executable feeds an unknown tensor"
                    ))
                })?;
            order.push(which);
        }
        if order.len() != placeholders.len() {
            return Err(Error::Device(format!(
                "Metal: a {what} executable with {} feeds, not {}",
                order.len(),
                placeholders.len()
            )));
        }
        // SAFETY: reading the built executable's targets.
        let targets = unsafe { exe.targetTensors() }
            .ok_or_else(|| missing("MPSGraphExecutable targetTensors"))?;
        let mut result_order = Vec::with_capacity(results.len());
        for i in 0..targets.count() {
            let t = targets.objectAtIndex(i);
            let which = results
                .iter()
                .position(|r| std::ptr::eq(*r, Retained::as_ptr(&t)))
                .ok_or_else(|| {
                    Error::Device(format!("Metal: a {what} executable has an unknown target"))
                })?;
            result_order.push(which);
        }
        if result_order.len() != results.len() {
            return Err(Error::Device(format!(
                "Metal: a {what} executable with {} results, not {}",
                result_order.len(),
                results.len()
            )));
        }
        Ok((exe, order, result_order))
    }
}

/// Encodes one dispatch on an open compute encoder.
fn encode_dispatch(
    enc: &ProtocolObject<dyn MTLComputeCommandEncoder>,
    d: &Dispatch<'_>,
) -> Result<()> {
    let lib = d
        .library
        .as_any()
        .downcast_ref::<SysLibrary>()
        .ok_or_else(|| Error::Internal("a foreign library on a Metal device".into()))?;
    let p = lib
        .pipelines
        .get(d.kernel)
        .ok_or_else(|| Error::Internal(format!("no kernel named '{}'", d.kernel)))?;
    if d.threads == 0 {
        return Ok(());
    }
    enc.setComputePipelineState(p);
    let record = NonNull::new(d.record.as_ptr() as *mut c_void)
        .ok_or_else(|| Error::Internal("empty launch record".into()))?;
    // SAFETY: setBytes copies `record.len()` bytes from a live slice into the command stream
    // at index 0, the index every kernel's record is declared at.
    unsafe { enc.setBytes_length_atIndex(record, d.record.len(), 0) };
    let width = p.maxTotalThreadsPerThreadgroup().clamp(1, 256);
    enc.dispatchThreads_threadsPerThreadgroup(
        MTLSize {
            width: d.threads,
            height: 1,
            depth: 1,
        },
        MTLSize {
            width,
            height: 1,
            depth: 1,
        },
    );
    Ok(())
}

fn sys_buffer(b: &Arc<dyn GpuBuffer>) -> Result<&SysBuffer> {
    b.as_any()
        .downcast_ref::<SysBuffer>()
        .ok_or_else(|| Error::Internal("a foreign buffer on a Metal device".into()))
}

fn sys_event(e: &Arc<dyn GpuEvent>) -> Result<&SysEvent> {
    e.as_any()
        .downcast_ref::<SysEvent>()
        .ok_or_else(|| Error::Internal("a foreign event on a Metal device".into()))
}

impl Gpu for MetalGpu {
    fn name(&self) -> String {
        format!("metal ({})", self.device.name())
    }
    fn new_buffer(&self, bytes: usize) -> Result<Arc<dyn GpuBuffer>> {
        let buf = self
            .device
            .newBufferWithLength_options(
                bytes.max(1),
                MTLResourceOptions::StorageModeShared
                    | MTLResourceOptions::CPUCacheModeDefaultCache,
            )
            .ok_or_else(|| {
                Error::Device(format!(
                    "Metal: cannot allocate a shared buffer of {bytes} bytes"
                ))
            })?;
        Ok(Arc::new(SysBuffer { buf, len: bytes }))
    }
    fn new_event(&self) -> Result<Arc<dyn GpuEvent>> {
        let ev = self
            .device
            .newSharedEvent()
            .ok_or_else(|| missing("newSharedEvent"))?;
        Ok(Arc::new(SysEvent { ev }))
    }
    fn compile(&self, source: &str) -> Result<Arc<dyn GpuLibrary>> {
        // IEEE semantics (NaN checks, infinities) as the CPU kernels have: no fast math.
        let options = MTLCompileOptions::new();
        #[allow(deprecated)] // `mathMode` replaces it only from macOS 15
        options.setFastMathEnabled(false);
        let lib = self
            .device
            .newLibraryWithSource_options_error(&NSString::from_str(source), Some(&options))
            .map_err(|e| ns_error("kernel source does not compile", &e))?;
        let mut pipelines = HashMap::new();
        for name in kernel_names(source) {
            let f = lib
                .newFunctionWithName(&NSString::from_str(&name))
                .ok_or_else(|| Error::Device(format!("Metal: no function '{name}' in library")))?;
            let p = self
                .device
                .newComputePipelineStateWithFunction_error(&f)
                .map_err(|e| ns_error(&format!("pipeline for '{name}'"), &e))?;
            pipelines.insert(name, p);
        }
        Ok(Arc::new(SysLibrary { pipelines }))
    }
    fn matmul(&self, key: MatmulKey, _library: &Arc<dyn GpuLibrary>) -> Result<Arc<dyn GpuMatmul>> {
        let [sa, sb, _] = key.shapes();
        let sbias = key.bias_shape();
        // SAFETY: graph construction from valid shapes and tensors of this graph; compile
        // blocks until the executable is built.
        let (exe, order) = unsafe {
            let graph = MPSGraph::new();
            let place = |s: &[usize]| {
                graph.placeholderWithShape_dataType_name(
                    Some(&ns_shape(s)),
                    MPSDataType::Float32,
                    None,
                )
            };
            let a = place(&sa);
            let b = place(&sb);
            let op_a = if key.ta {
                graph.transposeTensor_dimension_withDimension_name(&a, 1, 2, None)
            } else {
                a.clone()
            };
            let op_b = if key.tb {
                graph.transposeTensor_dimension_withDimension_name(&b, 1, 2, None)
            } else {
                b.clone()
            };
            // [a_batch, m, k] x [b_batch, k, n] broadcasts to [batch, m, n]
            let mut c = graph
                .matrixMultiplicationWithPrimaryTensor_secondaryTensor_name(&op_a, &op_b, None);
            let mut placeholders = vec![(a, sa.to_vec()), (b, sb.to_vec())];
            if key.epilogue.bias {
                let bias = place(&sbias);
                // [1, 1, n] broadcasts over batches and rows
                c = graph.additionWithPrimaryTensor_secondaryTensor_name(&c, &bias, None);
                placeholders.push((bias, sbias.to_vec()));
            }
            c = match key.epilogue.act {
                None => c,
                Some(Activation::Relu) => graph.reLUWithTensor_name(&c, None),
                Some(Activation::Tanh) => graph.tanhWithTensor_name(&c, None),
                Some(Activation::Sigmoid) => graph.sigmoidWithTensor_name(&c, None),
            };
            let (exe, order, _) = self.compile_graph(&graph, &placeholders, &[&c], "matmul")?;
            (exe, order)
        };
        Ok(Arc::new(SysMatmul {
            key,
            exe,
            order,
            encoding: Mutex::new(()),
        }))
    }
    fn attention(&self, key: AttentionKey) -> Result<Arc<dyn GpuAttention>> {
        let shapes = key.shapes();
        let off =
            match key.causal {
                Some(off) => Some(isize::try_from(off).map_err(|_| {
                    Error::Internal(format!("causal offset {off} past an NSInteger"))
                })?),
                None => None,
            };
        // SAFETY: graph construction from valid shapes and tensors of this graph; compile
        // blocks until the executable is built.
        let (exe, order, result_order) = unsafe {
            let graph = MPSGraph::new();
            let place = |s: &[usize]| {
                graph.placeholderWithShape_dataType_name(
                    Some(&ns_shape(s)),
                    MPSDataType::Float32,
                    None,
                )
            };
            let f32c = |v: f64| graph.constantWithScalar_dataType(v, MPSDataType::Float32);
            let t = |x: &MPSGraphTensor| {
                graph.transposeTensor_dimension_withDimension_name(x, 1, 2, None)
            };
            let mm = |a: &MPSGraphTensor, b: &MPSGraphTensor| {
                graph.matrixMultiplicationWithPrimaryTensor_secondaryTensor_name(a, b, None)
            };
            let mul = |a: &MPSGraphTensor, b: &MPSGraphTensor| {
                graph.multiplicationWithPrimaryTensor_secondaryTensor_name(a, b, None)
            };
            let reshape = |x: &MPSGraphTensor, dims: &[usize]| {
                graph.reshapeTensor_withShape_name(x, &ns_shape(dims), None)
            };
            let feeds: Vec<Retained<MPSGraphTensor>> =
                shapes[..key.feeds()].iter().map(|s| place(s)).collect();
            // Head-major arrays [bh, rows, cols] of q, k, v (and g): the feeds themselves, or
            // from the packed [b, t, 3, h, e] (and [b, t, h, e]) by slices and transposes.
            let (b, tokens) = (key.bh / key.heads.unwrap_or(1), key.l);
            // [b, t, h, e] -> [b, h, t, e] -> [b h, t, e]
            let heads = |x: &MPSGraphTensor| reshape(&t(x), &[key.bh, tokens, key.e]);
            let (q, k, v, g) = match key.heads {
                None => (
                    feeds[0].clone(),
                    feeds[1].clone(),
                    feeds[2].clone(),
                    feeds.get(3).cloned(),
                ),
                Some(h) => {
                    let part = |x: usize| {
                        let one = graph.sliceTensor_dimension_start_length_name(
                            &feeds[0], 2, x as isize, 1, None,
                        );
                        heads(&reshape(&one, &[b, tokens, h, key.e]))
                    };
                    let g = key.grad.then(|| heads(&feeds[1]));
                    (part(0), part(1), part(2), g)
                }
            };
            let (q, k, v) = (&q, &k, &v);
            // scores [bh, l, s] = scale * q k^T
            let scale = f32c(key.scale() as f64);
            let mut scores = mul(&mm(q, &t(k)), &scale);
            if let Some(off) = off {
                // Key j is seen by query i where j <= i + off: the band of an [l, s] matrix of
                // ones with every lower diagonal and `off` upper ones; the rest -inf.
                let ones = graph.constantWithScalar_shape_dataType(
                    1.0,
                    &ns_shape(&[key.l, key.s]),
                    MPSDataType::Float32,
                );
                let band = graph.bandPartWithTensor_numLower_numUpper_name(&ones, -1, off, None);
                let seen = graph.greaterThanWithPrimaryTensor_secondaryTensor_name(
                    &band,
                    &f32c(0.0),
                    None,
                );
                scores = graph
                    .selectWithPredicateTensor_truePredicateTensor_falsePredicateTensor_name(
                        &seen,
                        &scores,
                        &f32c(f64::NEG_INFINITY),
                        None,
                    );
            }
            let probs = graph.softMaxWithTensor_axis_name(&scores, 2, None);
            let mut results: Vec<Retained<MPSGraphTensor>> = if let Some(g) = &g {
                // dv = p^T g; dp = g v^T; ds = scale p (dp - rowsum(p dp)); dq = ds k;
                // dk = ds^T q (a hidden key has p = 0, so ds = 0 there)
                let dv = mm(&t(&probs), g);
                let dp = mm(g, &t(v));
                let rows = graph.reductionSumWithTensor_axis_name(&mul(&probs, &dp), 2, None);
                let centred =
                    graph.subtractionWithPrimaryTensor_secondaryTensor_name(&dp, &rows, None);
                let ds = mul(&mul(&probs, &centred), &scale);
                let dq = mm(&ds, k);
                let dk = mm(&t(&ds), q);
                vec![dq, dk, dv]
            } else {
                vec![mm(&probs, v)]
            };
            if let Some(h) = key.heads {
                // back to the packed layout: [b h, t, e] -> [b, h, t, e] -> [b, t, h, e], and
                // the gradient's dq, dk, dv side by side as [b, t, 3, h, e]
                let tokens_major = |x: &MPSGraphTensor| t(&reshape(x, &[b, h, tokens, key.e]));
                results = if key.grad {
                    let parts: Vec<Retained<MPSGraphTensor>> = results
                        .iter()
                        .map(|x| reshape(&tokens_major(x), &[b, tokens, 1, h, key.e]))
                        .collect();
                    let parts: Vec<&MPSGraphTensor> = parts.iter().map(|x| &**x).collect();
                    vec![graph.concatTensors_dimension_name(&NSArray::from_slice(&parts), 2, None)]
                } else {
                    vec![tokens_major(&results[0])]
                };
            }
            let placeholders: Vec<(Retained<MPSGraphTensor>, Vec<usize>)> = feeds
                .iter()
                .zip(&shapes)
                .map(|(f, s)| (f.clone(), s.to_vec()))
                .collect();
            let targets: Vec<&MPSGraphTensor> = results.iter().map(|r| &**r).collect();
            self.compile_graph(&graph, &placeholders, &targets, "attention")?
        };
        Ok(Arc::new(SysAttention {
            key,
            exe,
            order,
            result_order,
            encoding: Mutex::new(()),
        }))
    }
    fn compute(
        &self,
        waits: &[EventWait<'_>],
        work: &[Work<'_>],
        uses: &[Arc<dyn GpuBuffer>],
    ) -> Result<Box<dyn Submitted>> {
        let resident: Vec<&SysBuffer> = uses.iter().map(sys_buffer).collect::<Result<_>>()?;
        // SAFETY: a command buffer of our compute queue wrapped for MPS.
        let mps = unsafe { MPSCommandBuffer::commandBufferFromCommandQueue(&self.compute) };
        // SAFETY: reading the wrapper's current underlying command buffer.
        let mut cbs = CommandBuffers::new(CbRef(unsafe { mps.rootCommandBuffer() }));
        // (the device waits by itself: `progress` is the caller's to call while it does)
        for w in waits {
            let ev = sys_event(&w.event)?;
            mps.encodeWaitForEvent_value(ProtocolObject::from_ref(&*ev.ev), w.value);
        }
        let is_engine: Vec<bool> = work.iter().map(Work::is_engine).collect();
        for seg in segments(&is_engine) {
            match seg {
                Segment::Kernels(range) => {
                    // Made now, from the current command buffer (an engine encode before this
                    // one may have committed the previous one).
                    let enc = mps
                        .computeCommandEncoder()
                        .ok_or_else(|| missing("computeCommandEncoder"))?;
                    for b in &resident {
                        enc.useResource_usage(
                            ProtocolObject::from_ref(&*b.buf),
                            MTLResourceUsage::Read | MTLResourceUsage::Write,
                        );
                    }
                    let r = work[range].iter().try_for_each(|w| match w {
                        Work::Kernel(d) => encode_dispatch(&enc, d),
                        _ => Err(Error::Internal("an engine item in a kernel run".into())),
                    });
                    enc.endEncoding();
                    r?;
                }
                Segment::Matmul(i) => match &work[i] {
                    Work::Kernel(_) => {
                        return Err(Error::Internal("a kernel in an engine segment".into()));
                    }
                    Work::Matmul(call) => {
                        let mm =
                            call.exe
                                .as_any()
                                .downcast_ref::<SysMatmul>()
                                .ok_or_else(|| {
                                    Error::Internal("a foreign matmul on a Metal device".into())
                                })?;
                        let [sa, sb, sc] = mm.key.shapes();
                        let mut arrays = vec![
                            tensor_data(sys_buffer(call.a.0)?, call.a.1, &sa)?,
                            tensor_data(sys_buffer(call.b.0)?, call.b.1, &sb)?,
                        ];
                        match (mm.key.epilogue.bias, call.bias) {
                            (true, Some((buf, off))) => arrays.push(tensor_data(
                                sys_buffer(buf)?,
                                off,
                                &mm.key.bias_shape(),
                            )?),
                            (false, None) => {}
                            _ => {
                                return Err(Error::Internal(
                                    "an engine matmul's bias does not match its key".into(),
                                ))
                            }
                        }
                        let c = tensor_data(sys_buffer(call.c.0)?, call.c.1, &sc)?;
                        encode_exe(
                            &mps,
                            &mut cbs,
                            (&mm.exe, &mm.order, &mm.encoding),
                            &arrays,
                            (&[c], &[0]),
                        );
                    }
                    Work::Attention(call) => {
                        let at = call
                            .exe
                            .as_any()
                            .downcast_ref::<SysAttention>()
                            .ok_or_else(|| {
                                Error::Internal("a foreign attention on a Metal device".into())
                            })?;
                        let shapes = at.key.shapes();
                        if call.arrays.len() != shapes.len() {
                            return Err(Error::Internal(format!(
                                "an engine attention of {} arrays, not {}",
                                call.arrays.len(),
                                shapes.len()
                            )));
                        }
                        let arrays: Vec<Retained<MPSGraphTensorData>> = call
                            .arrays
                            .iter()
                            .zip(&shapes)
                            .map(|(&(buf, off), shape)| tensor_data(sys_buffer(buf)?, off, shape))
                            .collect::<Result<_>>()?;
                        let (feeds, results) = arrays.split_at(at.key.feeds());
                        encode_exe(
                            &mps,
                            &mut cbs,
                            (&at.exe, &at.order, &at.encoding),
                            feeds,
                            (results, &at.result_order),
                        );
                    }
                },
            }
        }
        mps.commit();
        Ok(Box::new(SysSubmitted {
            cbs: cbs.all().iter().map(|c| c.0.clone()).collect(),
            _keep: uses.to_vec(),
        }))
    }
    fn blit(
        &self,
        copy: BlitCopy,
        event: &Arc<dyn GpuEvent>,
        value: u64,
    ) -> Result<Box<dyn Submitted>> {
        let ev = sys_event(event)?;
        let (src, dst) = (sys_buffer(&copy.src)?, sys_buffer(&copy.dst)?);
        let cb = self
            .blit
            .commandBuffer()
            .ok_or_else(|| missing("commandBuffer"))?;
        if copy.bytes > 0 {
            let enc = cb
                .blitCommandEncoder()
                .ok_or_else(|| missing("blitCommandEncoder"))?;
            // SAFETY: the copy engine checked both ranges against the buffers' sizes at issue,
            // and both buffers stay alive in the returned submission until it completed.
            unsafe {
                enc.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                    &src.buf,
                    copy.src_offset,
                    &dst.buf,
                    copy.dst_offset,
                    copy.bytes,
                )
            };
            enc.endEncoding();
        }
        cb.encodeSignalEvent_value(ProtocolObject::from_ref(&*ev.ev), value);
        cb.commit();
        Ok(Box::new(SysSubmitted {
            cbs: vec![cb],
            _keep: vec![copy.src, copy.dst],
        }))
    }
}
