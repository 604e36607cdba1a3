//! `TensorSharding`: for each tensor dim the mesh axes it is split over (major to minor), plus
//! the axes over which the value is an unreduced partial sum (Shardy's representation;
//! DTensor's Shard / Replicate / Partial).

use super::mesh::{AxisId, Mesh};
use serde::{Deserialize, Serialize};

/// How one tensor is laid out over the mesh. An axis appears at most once in `dims` and
/// `partial` together; axes that appear nowhere replicate the tensor.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorSharding {
    /// Per tensor dim, the axes splitting it, major to minor.
    pub dims: Vec<Vec<AxisId>>,
    /// Axes over which the local values are partial sums.
    pub partial: Vec<AxisId>,
}

impl TensorSharding {
    /// Fully replicated, for a tensor of `rank` dims.
    pub fn replicated(rank: usize) -> TensorSharding {
        TensorSharding {
            dims: vec![Vec::new(); rank],
            partial: Vec::new(),
        }
    }

    /// Replicated except dim `dim` split over `axes`.
    pub fn split(rank: usize, dim: usize, axes: &[AxisId]) -> TensorSharding {
        let mut s = TensorSharding::replicated(rank);
        s.dims[dim] = axes.to_vec();
        s
    }

    /// True when no dim is split and nothing is partial.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.dims.iter().all(Vec::is_empty)
    }

    /// Every axis used (by dims or partial).
    pub fn used_axes(&self) -> Vec<AxisId> {
        let mut v: Vec<AxisId> = self.dims.iter().flatten().copied().collect();
        v.extend(&self.partial);
        v
    }

    /// Product of the axis sizes splitting dim `d`.
    pub fn parts(&self, mesh: &Mesh, d: usize) -> usize {
        self.dims[d].iter().map(|&a| mesh.axis_size(a)).product()
    }

    /// The local shape of a tensor of global shape `global`, or the first dim that does not
    /// divide: `Err((dim, size, parts))`.
    pub fn local_shape(
        &self,
        mesh: &Mesh,
        global: &[usize],
    ) -> Result<Vec<usize>, (usize, usize, usize)> {
        global
            .iter()
            .enumerate()
            .map(|(d, &s)| {
                let p = self.parts(mesh, d);
                if s % p == 0 {
                    Ok(s / p)
                } else {
                    Err((d, s, p))
                }
            })
            .collect()
    }

    /// Text form with axis names: `[dp,-,tp] partial(tp)`, or `replicated`.
    pub fn display(&self, mesh: &Mesh) -> String {
        if self.is_replicated() {
            return "replicated".into();
        }
        let dims: Vec<String> = self
            .dims
            .iter()
            .map(|axes| {
                if axes.is_empty() {
                    "-".to_string()
                } else {
                    axes.iter()
                        .map(|&a| mesh.axis_name(a).to_string())
                        .collect::<Vec<_>>()
                        .join("*")
                }
            })
            .collect();
        let mut s = format!("[{}]", dims.join(","));
        if !self.partial.is_empty() {
            let p: Vec<&str> = self.partial.iter().map(|&a| mesh.axis_name(a)).collect();
            s.push_str(&format!(" partial({})", p.join(",")));
        }
        s
    }
}
