//! Device mesh: named axes with sizes and link classes. Ranks are row-major over the axes (the
//! last axis varies fastest), so with `dp=2,tp=4` ranks 0..4 form the first `tp` group.

use crate::model::MAX_RANKS;
use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// Index of an axis in its mesh. Displays as `a0`; use [`Mesh::axis_name`] for the name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AxisId(pub u8);

impl fmt::Display for AxisId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

/// The interconnect an axis' collectives run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkClass {
    /// Inside a node (NVLink / NVSwitch).
    Nvlink,
    /// Across nodes (InfiniBand / RoCE).
    Ib,
    /// PCIe inside a node.
    Pcie,
}

impl LinkClass {
    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            LinkClass::Nvlink => "nvlink",
            LinkClass::Ib => "ib",
            LinkClass::Pcie => "pcie",
        }
    }
}

/// One mesh axis.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    /// Name (`dp`, `tp`, `ep`, `pp`, ...).
    pub name: String,
    /// Number of ranks along it.
    pub size: usize,
    /// Link class of its groups.
    pub link: LinkClass,
}

/// A mesh that could not be built. Meshes come from `--mesh`, which the messages name.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum MeshError {
    /// The text form is malformed.
    #[error("--mesh {text:?}: {msg} (expected e.g. `dp=2,tp=4`)")]
    Syntax {
        /// Input.
        text: String,
        /// What is wrong.
        msg: String,
    },
    /// An axis name is used twice.
    #[error("--mesh: axis `{0}` appears twice")]
    Duplicate(String),
    /// An axis name is not known.
    #[error("--mesh: unknown mesh axis `{name}`; valid axes: {valid}")]
    UnknownAxis {
        /// The name.
        name: String,
        /// Valid names, comma-separated.
        valid: String,
    },
    /// More ranks than [`MAX_RANKS`].
    #[error("--mesh {text:?}: {ranks} ranks, more than the {MAX_RANKS} supported")]
    TooManyRanks {
        /// Input.
        text: String,
        /// The product of the axis sizes (saturated).
        ranks: u128,
    },
    /// A node of no GPUs.
    #[error("--gpus-per-node: must be at least 1 (found {0})")]
    GpusPerNode(usize),
}

/// Axis names the strategies understand.
pub const KNOWN_AXES: [&str; 6] = ["dp", "tp", "ep", "pp", "cp", "fsdp"];

/// The axes whose ranks hold different tokens: `dp`, and `ep` outside the experts.
pub const DATA_AXES: [&str; 2] = ["dp", "ep"];

/// A device mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    /// Axes, outermost first.
    pub axes: Vec<MeshAxis>,
    /// GPUs that share a node (NVLink domain).
    pub gpus_per_node: usize,
}

impl Mesh {
    /// Parses `dp=2,tp=4`: known axis names, each once, sizes ≥ 1, at most [`MAX_RANKS`]
    /// ranks, `gpus_per_node` ≥ 1. Link classes are assigned from the innermost axis outwards:
    /// axes whose cumulative size fits in `gpus_per_node` are `nvlink`, the rest `ib`.
    pub fn parse(text: &str, gpus_per_node: usize) -> Result<Mesh, MeshError> {
        let syntax = |msg: String| MeshError::Syntax {
            text: text.to_string(),
            msg,
        };
        if gpus_per_node == 0 {
            return Err(MeshError::GpusPerNode(gpus_per_node));
        }
        let mut axes: Vec<MeshAxis> = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, size) = part
                .split_once('=')
                .ok_or_else(|| syntax(format!("`{part}` is not `name=size`")))?;
            let name = name.trim();
            if !KNOWN_AXES.contains(&name) {
                return Err(MeshError::UnknownAxis {
                    name: name.to_string(),
                    valid: KNOWN_AXES.join(", "),
                });
            }
            let size: usize = size.trim().parse().ok().filter(|&s| s > 0).ok_or_else(|| {
                syntax(format!(
                    "size of `{name}` must be a positive integer (found `{}`)",
                    size.trim()
                ))
            })?;
            if axes.iter().any(|a| a.name == name) {
                return Err(MeshError::Duplicate(name.to_string()));
            }
            axes.push(MeshAxis {
                name: name.to_string(),
                size,
                link: LinkClass::Nvlink,
            });
        }
        if axes.is_empty() {
            return Err(syntax("no axes".into()));
        }
        let ranks = axes
            .iter()
            .fold(1u128, |r, a| r.saturating_mul(a.size as u128));
        if ranks > MAX_RANKS as u128 {
            return Err(MeshError::TooManyRanks {
                text: text.to_string(),
                ranks,
            });
        }
        let mut m = Mesh {
            axes,
            gpus_per_node,
        };
        m.assign_links();
        Ok(m)
    }

    /// A single-rank mesh with no axes (unsharded).
    pub fn single() -> Mesh {
        Mesh {
            axes: Vec::new(),
            gpus_per_node: 8,
        }
    }

    fn assign_links(&mut self) {
        let mut inner = 1usize;
        for a in self.axes.iter_mut().rev() {
            inner *= a.size;
            a.link = if inner <= self.gpus_per_node {
                LinkClass::Nvlink
            } else {
                LinkClass::Ib
            };
        }
    }

    /// This mesh without axis `name` (the others keep their sizes and link classes): e.g. the
    /// mesh of one pipeline stage.
    pub fn without_axis(&self, name: &str) -> Mesh {
        Mesh {
            axes: self
                .axes
                .iter()
                .filter(|a| a.name != name)
                .cloned()
                .collect(),
            gpus_per_node: self.gpus_per_node,
        }
    }

    /// Rank `rank`'s coordinates as text, `dp=0,tp=1`.
    pub fn coords_label(&self, rank: usize) -> String {
        self.coords(rank)
            .iter()
            .zip(&self.axes)
            .map(|(c, a)| format!("{}={c}", a.name))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Total ranks.
    pub fn world_size(&self) -> usize {
        self.axes.iter().map(|a| a.size).product()
    }

    /// The id of the axis named `name`.
    pub fn axis(&self, name: &str) -> Option<AxisId> {
        self.axes
            .iter()
            .position(|a| a.name == name)
            .map(|i| AxisId(i as u8))
    }

    /// The name of axis `a`.
    pub fn axis_name(&self, a: AxisId) -> &str {
        &self.axes[a.0 as usize].name
    }

    /// The size of axis `a`.
    pub fn axis_size(&self, a: AxisId) -> usize {
        self.axes[a.0 as usize].size
    }

    /// Ranks that hold different tokens: the product of the [`DATA_AXES`] (1 without them).
    pub fn data_ranks(&self) -> usize {
        DATA_AXES
            .iter()
            .filter_map(|n| self.axis(n))
            .map(|a| self.axis_size(a))
            .product()
    }

    /// Axis ids in order.
    pub fn axis_ids(&self) -> impl Iterator<Item = AxisId> {
        (0..self.axes.len() as u8).map(AxisId)
    }

    /// Coordinates of `rank`, one per axis.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut c = vec![0; self.axes.len()];
        let mut r = rank;
        for (i, a) in self.axes.iter().enumerate().rev() {
            c[i] = r % a.size;
            r /= a.size;
        }
        c
    }

    /// The rank at `coords`.
    pub fn rank_of(&self, coords: &[usize]) -> usize {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |r, (a, &c)| r * a.size + c)
    }

    /// Ranks between neighbours along `axis`: the product of the inner axes' sizes.
    pub fn stride(&self, axis: AxisId) -> usize {
        self.axes[axis.0 as usize + 1..]
            .iter()
            .map(|a| a.size)
            .product()
    }

    /// The ranks that differ from rank 0 only in the coordinates of `axes`, ascending: with
    /// one axis, its first group (`groups(axis)[0]`), without enumerating the others.
    pub fn group_of_first(&self, axes: &[AxisId]) -> Vec<usize> {
        let mut out = vec![0];
        for a in self.axis_ids().filter(|a| axes.contains(a)) {
            let stride = self.stride(a);
            out = out
                .iter()
                .flat_map(|&r| (0..self.axis_size(a)).map(move |k| r + k * stride))
                .collect();
        }
        out
    }

    /// The groups of `axis`: sets of ranks that differ only in that coordinate, each ordered by
    /// the coordinate; groups ordered by their first rank.
    pub fn groups(&self, axis: AxisId) -> Vec<Vec<usize>> {
        let i = axis.0 as usize;
        let mut out = Vec::new();
        for r in 0..self.world_size() {
            let c = self.coords(r);
            if c[i] != 0 {
                continue;
            }
            out.push(
                (0..self.axes[i].size)
                    .map(|k| {
                        let mut cc = c.clone();
                        cc[i] = k;
                        self.rank_of(&cc)
                    })
                    .collect(),
            );
        }
        out
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.axes.is_empty() {
            return f.write_str("single");
        }
        for (i, a) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", a.name, a.size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_ranks_row_major() {
        let m = Mesh::parse("dp=2,tp=4", 8).unwrap();
        assert_eq!(m.world_size(), 8);
        assert_eq!(m.coords(5), vec![1, 1]);
        assert_eq!(m.rank_of(&[1, 1]), 5);
        let tp = m.axis("tp").unwrap();
        assert_eq!(m.groups(tp), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        let dp = m.axis("dp").unwrap();
        assert_eq!(
            m.groups(dp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(m.to_string(), "dp=2,tp=4");
    }

    /// The group of rank 0 over some axes is every rank whose other coordinates are 0, in
    /// order; over one axis, that axis's first group.
    #[test]
    fn group_of_first_is_the_filtered_ranks() {
        let m = Mesh::parse("pp=2,dp=3,ep=2,cp=2,tp=2", 8).unwrap();
        let ids: Vec<AxisId> = m.axis_ids().collect();
        for mask in 0u32..1 << ids.len() {
            let axes: Vec<AxisId> = ids
                .iter()
                .copied()
                .filter(|a| mask & (1 << a.0) != 0)
                .collect();
            let want: Vec<usize> = (0..m.world_size())
                .filter(|&r| {
                    m.coords(r)
                        .iter()
                        .enumerate()
                        .all(|(a, &c)| c == 0 || axes.contains(&AxisId(a as u8)))
                })
                .collect();
            assert_eq!(m.group_of_first(&axes), want, "{axes:?}");
            if let [a] = axes[..] {
                assert_eq!(m.group_of_first(&axes), m.groups(a)[0]);
            }
        }
        assert_eq!(m.stride(m.axis("dp").unwrap()), 8);
    }

    #[test]
    fn links_from_node_size() {
        let m = Mesh::parse("dp=4,tp=8", 8).unwrap();
        assert_eq!(m.axes[1].link, LinkClass::Nvlink);
        assert_eq!(m.axes[0].link, LinkClass::Ib);
        let m = Mesh::parse("dp=2,tp=4", 8).unwrap();
        assert!(m.axes.iter().all(|a| a.link == LinkClass::Nvlink));
    }

    #[test]
    fn errors() {
        assert!(matches!(
            Mesh::parse("xx=2", 8),
            Err(MeshError::UnknownAxis { .. })
        ));
        assert!(Mesh::parse("xx=2", 8)
            .unwrap_err()
            .to_string()
            .contains("dp, tp"));
        assert!(matches!(
            Mesh::parse("tp=2,tp=2", 8),
            Err(MeshError::Duplicate(_))
        ));
        assert!(matches!(
            Mesh::parse("tp=0", 8),
            Err(MeshError::Syntax { .. })
        ));
        assert!(matches!(
            Mesh::parse("tp", 8),
            Err(MeshError::Syntax { .. })
        ));
        assert!(matches!(Mesh::parse("", 8), Err(MeshError::Syntax { .. })));
        assert_eq!(Mesh::parse("tp=2", 0), Err(MeshError::GpusPerNode(0)));
        let e = Mesh::parse("dp=0", 8).unwrap_err().to_string();
        assert!(
            e.starts_with("--mesh") && e.contains("`dp`") && e.contains("`0`"),
            "{e}"
        );
        // 10,000-GPU meshes parse; more ranks than supported (or than usize holds) do not.
        assert_eq!(
            Mesh::parse("dp=125,tp=8,pp=10", 8).unwrap().world_size(),
            10_000
        );
        assert!(matches!(
            Mesh::parse("dp=1048576,tp=2", 8),
            Err(MeshError::TooManyRanks { ranks: 2097152, .. })
        ));
        assert!(matches!(
            Mesh::parse("dp=4294967296,tp=4294967296,pp=4294967296", 8),
            Err(MeshError::TooManyRanks { .. })
        ));
    }
}
