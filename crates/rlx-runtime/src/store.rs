//! Resident stores: a model's weights, or an optimizer's state, in one device buffer by name.
use crate::{backend::check_range, Backend, DeviceBuffer, Error, OptimRule, Result};
use rlx_ir::{planner::align_up, DType, Shape};
use std::sync::{Arc, Mutex, MutexGuard};

/// One named tensor in a store.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreEntry {
    pub name: String,
    pub offset: usize,
    pub shape: Shape,
    pub dtype: DType,
}

impl StoreEntry {
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
}

/// Named tensors packed into one device buffer. Executables share a store through an `Arc`;
/// its run lock serialises every executable that updates or reads it.
pub struct Store {
    buffer: Arc<dyn DeviceBuffer>,
    entries: Vec<StoreEntry>,
    device: String,
    run_lock: Mutex<()>,
}

impl Store {
    /// Lays out `specs` (aligned for the backend) in one fresh zeroed allocation.
    pub fn new(backend: &dyn Backend, specs: &[(String, Shape, DType)]) -> Result<Store> {
        let align = backend.alignment();
        let mut entries = Vec::with_capacity(specs.len());
        let mut offset = 0;
        for (name, shape, dtype) in specs {
            if entries.iter().any(|e: &StoreEntry| &e.name == name) {
                return Err(Error::Graph(format!("the name '{name}' appears twice")));
            }
            let e = StoreEntry {
                name: name.clone(),
                offset,
                shape: shape.clone(),
                dtype: *dtype,
            };
            offset = align_up(offset + e.bytes(), align);
            entries.push(e);
        }
        let buffer = backend.alloc(offset)?;
        Ok(Store {
            buffer,
            entries,
            device: backend.name(),
            run_lock: Mutex::new(()),
        })
    }

    /// The state an optimizer with `rule` keeps for the float32 and float64 tensors of `params`
    /// (in the tensor's dtype): per tensor
    /// its rule's buffers (`"{name}.{slot}"`), an int32 update count (`"{name}.step"`) and, for
    /// SGD, whether the momentum buffer holds a value (`"{name}.started"`). With `hyper_table`,
    /// also the `hyper` table, one row of settings per such tensor (parameter groups), which the
    /// update then reads instead of the run's single set of hyper-parameters.
    pub fn for_optimizer(
        backend: &dyn Backend,
        rule: OptimRule,
        params: &Store,
        hyper_table: bool,
    ) -> Result<Store> {
        let mut specs = Vec::new();
        // float32 and float64 tensors are trained, with state of their dtype (integer and
        // bool buffers, and low-precision weights, which are not trained, get none).
        let trainable: Vec<&StoreEntry> = params
            .entries()
            .iter()
            .filter(|p| p.dtype.is_trainable())
            .collect();
        for p in &trainable {
            for s in rule.slots() {
                specs.push((format!("{}.{s}", p.name), p.shape.clone(), p.dtype));
            }
            specs.push((format!("{}.step", p.name), Shape::scalar(), DType::I32));
            if rule == OptimRule::Sgd {
                specs.push((format!("{}.started", p.name), Shape::scalar(), DType::I32));
            }
        }
        if hyper_table {
            // float64 where a float64 tensor is trained, so its settings keep double precision
            // (a float32 tensor's update narrows them back to the values a float32 table holds).
            let wide = trainable.iter().any(|p| p.dtype == DType::F64);
            specs.push((
                "hyper".to_string(),
                Shape::new([trainable.len(), crate::hyper_col::LEN]),
                if wide { DType::F64 } else { DType::F32 },
            ));
        }
        Store::new(backend, &specs)
    }

    pub fn entries(&self) -> &[StoreEntry] {
        &self.entries
    }

    pub fn entry(&self, name: &str) -> Option<&StoreEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    pub fn buffer(&self) -> &Arc<dyn DeviceBuffer> {
        &self.buffer
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    pub fn bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Held for the whole of every run that touches this store.
    pub fn lock(&self) -> MutexGuard<'_, ()> {
        self.run_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn named(&self, name: &str) -> Result<&StoreEntry> {
        self.entry(name)
            .ok_or_else(|| Error::input(name, "no such tensor in this store"))
    }

    /// Overwrites the tensor `name` with `data` (its exact byte size).
    pub fn write(&self, name: &str, data: &[u8]) -> Result<()> {
        self.write_many(&[(name, data)])
    }

    /// Overwrites several tensors as one change: every name and size is checked first, then all
    /// are written under the run lock, so no run sees some of them old and some new.
    pub fn write_many(&self, tensors: &[(&str, &[u8])]) -> Result<()> {
        let mut placed = Vec::with_capacity(tensors.len());
        for (i, (name, data)) in tensors.iter().enumerate() {
            if tensors[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::input(*name, "given twice"));
            }
            let e = self.named(name)?;
            if data.len() != e.bytes() {
                return Err(Error::shape(
                    *name,
                    format!(
                        "expected {} bytes for shape {} {}, got {}",
                        e.bytes(),
                        e.shape,
                        e.dtype,
                        data.len()
                    ),
                ));
            }
            check_range(name, e.offset, data.len(), self.buffer.len())?;
            placed.push((e.offset, *data));
        }
        let _guard = self.lock();
        for (offset, data) in placed {
            self.buffer.write(offset, data)?;
        }
        Ok(())
    }

    /// A copy of every tensor, taken under the run lock: one consistent snapshot (no run is
    /// halfway through an update while it is read).
    pub fn read_all(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let _guard = self.lock();
        self.entries
            .iter()
            .map(|e| {
                let mut out = vec![0; e.bytes()];
                self.buffer.read(e.offset, &mut out)?;
                Ok((e.name.clone(), out))
            })
            .collect()
    }

    /// Copies out the tensor `name`.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let e = self.named(name)?;
        let mut out = vec![0; e.bytes()];
        let _guard = self.lock();
        self.buffer.read(e.offset, &mut out)?;
        Ok(out)
    }
}
