//! Element types a tensor can hold.
use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        4
    }

    /// The numpy-style name ("float32", "int32").
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::I32 => "int32",
        }
    }

    /// Parses a numpy-style name.
    pub fn parse(name: &str) -> Option<DType> {
        match name {
            "float32" | "f32" => Some(DType::F32),
            "int32" | "i32" => Some(DType::I32),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
