//! Tensor shapes and numpy broadcasting.
use std::fmt;

/// A tensor shape: the size of each dimension, outermost first. `[]` is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(dims.into())
    }
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
    /// The numpy broadcast of two shapes, or `None` if they do not broadcast.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let n = a.rank().max(b.rank());
        let mut out = vec![0; n];
        for (i, o) in out.iter_mut().enumerate() {
            let da = dim_from_right(a, n - 1 - i);
            let db = dim_from_right(b, n - 1 - i);
            *o = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(out))
    }
    /// Normalises a possibly negative axis against this rank.
    pub fn axis(&self, axis: i64) -> Option<usize> {
        let r = self.rank() as i64;
        let a = if axis < 0 { axis + r } else { axis };
        (0..r).contains(&a).then_some(a as usize)
    }
}

fn dim_from_right(s: &Shape, k: usize) -> usize {
    if k < s.rank() {
        s.0[s.rank() - 1 - k]
    } else {
        1
    }
}

impl fmt::Display for Shape {
    /// Python tuple notation: `(3, 4)`, `(5,)`, `()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [d] => write!(f, "({d},)"),
            dims => {
                let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
                write!(f, "({})", parts.join(", "))
            }
        }
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape(d.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        let b = |x: &[usize], y: &[usize]| Shape::broadcast(&x.into(), &y.into());
        assert_eq!(b(&[3, 4], &[4]), Some(Shape::new([3, 4])));
        assert_eq!(b(&[2, 1, 4], &[3, 1]), Some(Shape::new([2, 3, 4])));
        assert_eq!(b(&[], &[5]), Some(Shape::new([5])));
        assert_eq!(b(&[3, 4], &[5]), None);
        assert_eq!(b(&[0, 4], &[1, 4]), Some(Shape::new([0, 4])));
    }

    #[test]
    fn strides_and_display() {
        assert_eq!(Shape::new([2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(Shape::new([5]).to_string(), "(5,)");
        assert_eq!(Shape::new([3, 4]).to_string(), "(3, 4)");
        assert_eq!(Shape::scalar().to_string(), "()");
    }
}
