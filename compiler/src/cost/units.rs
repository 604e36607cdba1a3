//! Cost newtypes: the unit is in the name. Arithmetic saturates: a sum that overflows becomes
//! the `INFINITE` sentinel, so "does not fit" and "never finishes" stay comparable.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Mul, Sub};

/// A duration in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seconds(pub f64);

impl Seconds {
    /// No time.
    pub const ZERO: Seconds = Seconds(0.0);
    /// Never finishes.
    pub const INFINITE: Seconds = Seconds(f64::INFINITY);

    /// The larger of two durations.
    pub fn max(self, o: Seconds) -> Seconds {
        if self.0 >= o.0 {
            self
        } else {
            o
        }
    }

    /// The smaller of two durations.
    pub fn min(self, o: Seconds) -> Seconds {
        if self.0 <= o.0 {
            self
        } else {
            o
        }
    }

    /// True for the sentinel (or anything non-finite).
    pub fn is_infinite(self) -> bool {
        !self.0.is_finite()
    }
}

impl Add for Seconds {
    type Output = Seconds;
    fn add(self, o: Seconds) -> Seconds {
        let s = self.0 + o.0;
        if s.is_finite() {
            Seconds(s)
        } else {
            Seconds::INFINITE
        }
    }
}

impl AddAssign for Seconds {
    fn add_assign(&mut self, o: Seconds) {
        *self = *self + o;
    }
}

impl Sub for Seconds {
    type Output = Seconds;
    /// Saturates at zero (and keeps `INFINITE`).
    fn sub(self, o: Seconds) -> Seconds {
        if self.is_infinite() {
            return Seconds::INFINITE;
        }
        Seconds((self.0 - o.0).max(0.0))
    }
}

impl Mul<f64> for Seconds {
    type Output = Seconds;
    fn mul(self, k: f64) -> Seconds {
        let s = self.0 * k;
        if s.is_finite() {
            Seconds(s)
        } else {
            Seconds::INFINITE
        }
    }
}

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        if !s.is_finite() {
            f.write_str("∞")
        } else if s >= 1.0 {
            write!(f, "{s:.3} s")
        } else if s >= 1e-3 {
            write!(f, "{:.3} ms", s * 1e3)
        } else {
            write!(f, "{:.2} µs", s * 1e6)
        }
    }
}

/// A size in bytes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Bytes {
    /// Nothing.
    pub const ZERO: Bytes = Bytes(0);
    /// Larger than any memory.
    pub const INFINITE: Bytes = Bytes(u64::MAX);

    /// `n` elements of `bytes_per` bytes each, saturating.
    pub fn of(n: u64, bytes_per: u64) -> Bytes {
        Bytes(n.saturating_mul(bytes_per))
    }

    /// As a float (for rates).
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }
}

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, o: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(o.0))
    }
}

impl AddAssign for Bytes {
    fn add_assign(&mut self, o: Bytes) {
        *self = *self + o;
    }
}

impl Mul<u64> for Bytes {
    type Output = Bytes;
    fn mul(self, k: u64) -> Bytes {
        Bytes(self.0.saturating_mul(k))
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        iter.fold(Bytes::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Bytes::INFINITE {
            return f.write_str("∞");
        }
        let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut x = self.0 as f64;
        let mut u = 0;
        while x >= 1024.0 && u + 1 < units.len() {
            x /= 1024.0;
            u += 1;
        }
        if u == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{x:.2} {}", units[u])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_saturate_to_infinite() {
        assert_eq!(Seconds(1.0) + Seconds(2.0), Seconds(3.0));
        assert!((Seconds::INFINITE + Seconds(1.0)).is_infinite());
        assert!((Seconds(f64::MAX) + Seconds(f64::MAX)).is_infinite());
        assert_eq!(Seconds(1.0) - Seconds(2.0), Seconds::ZERO);
        assert!((Seconds::INFINITE - Seconds(5.0)).is_infinite());
        assert!((Seconds(f64::MAX) * 2.0).is_infinite());
        assert_eq!(Seconds(1.0).max(Seconds(2.0)), Seconds(2.0));
        assert_eq!(Seconds(1.0).min(Seconds::INFINITE), Seconds(1.0));
    }

    #[test]
    fn bytes_saturate_to_infinite() {
        assert_eq!(Bytes(3) + Bytes(4), Bytes(7));
        assert_eq!(Bytes::INFINITE + Bytes(1), Bytes::INFINITE);
        assert_eq!(Bytes(u64::MAX / 2 + 1) * 2, Bytes::INFINITE);
        assert_eq!(Bytes::of(u64::MAX, 2), Bytes::INFINITE);
        assert_eq!([Bytes(1), Bytes(2)].into_iter().sum::<Bytes>(), Bytes(3));
        assert_eq!(Bytes(1536).to_string(), "1.50 KiB");
        assert_eq!(Bytes::INFINITE.to_string(), "∞");
    }
}
