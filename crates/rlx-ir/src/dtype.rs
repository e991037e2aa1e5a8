//! Element types a tensor can hold: their sizes, names and kinds.
use std::fmt;

/// The element type of a tensor. Every dtype can be stored, fed, read back, moved (reshape,
/// transpose, slice, ...) and cast; arithmetic kernels exist for `F32`, for `I32` and `I64`
/// (binary ops, comparisons, sums and maxima), and `Bool` is a `where` condition (the front
/// end casts it for arithmetic); shape inference refuses the rest with a `DTypeError` naming
/// the op. bfloat16/float16 operands of other ops are widened (see `Graph::add`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    I32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: the top half of a float32 (8 exponent bits, 7 mantissa bits).
    BF16,
    F64,
    I64,
    /// One byte per element, 0 or 1.
    Bool,
}

impl DType {
    /// Every dtype, in a fixed order (for tests and listings).
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::I32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I64,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// The numpy-style name ("float32", "bfloat16", "int64", "bool", ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::I32 => "int32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Parses a numpy-style name (or its short form: "f32", "bf16", "i64", ...).
    pub fn parse(name: &str) -> Option<DType> {
        Some(match name {
            "float32" | "f32" => DType::F32,
            "int32" | "i32" => DType::I32,
            "float16" | "f16" | "half" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float64" | "f64" | "double" => DType::F64,
            "int64" | "i64" => DType::I64,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    /// True for the floating-point dtypes (the ones gradients flow through).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// True for bfloat16 and float16: the dtypes of mixed-precision compute. A matmul of two
    /// operands of one of them multiplies in that precision, sums in float32 and returns
    /// float32 (PyTorch's autocast returns the low-precision dtype; rlx keeps the float32 sum,
    /// which the ops after a matmul, e.g. a bias add or a norm, use at no extra cost).
    pub fn is_low_precision(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// Whether weights of this dtype are trained (float32 everywhere, float64 on the CPU), with
    /// optimizer state of the same dtype. Low-precision weights train through float32 master
    /// weights (`precision="bf16"`), integer and bool tensors are never trained.
    pub fn is_trainable(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    /// The message (after the `[op]` prefix) for an op whose kernels do not exist for these
    /// operand dtypes yet, e.g. `float16 x float16 is not supported yet; cast to float32 with
    /// .astype('float32')` (integers have only elementwise ops, sums and maxima: everything
    /// else wants floats).
    pub fn not_supported(dtypes: &[DType]) -> String {
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        format!(
            "{} is not supported yet; cast to float32 with .astype('float32')",
            names.join(" x ")
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn sizes_names_and_parsing_agree() {
        let sizes: Vec<usize> = DType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [4, 4, 2, 2, 8, 8, 1]);
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::parse("uint8"), None);
        let msg = DType::not_supported(&[DType::F16, DType::F16]);
        assert_eq!(
            msg,
            "float16 x float16 is not supported yet; cast to float32 with .astype('float32')"
        );
        assert!(DType::not_supported(&[DType::I64]).ends_with(".astype('float32')"));
    }
}
