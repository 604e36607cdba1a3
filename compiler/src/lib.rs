//! shardc-compiler: the tensor IR, model import, sharding, rewriting, planning and cost model.
//! No GPU dependency.
#![deny(missing_docs)]

/// The text names of fieldless enum `$t` (the IR's, the CLI's and the configs'): `ALL` (every
/// variant, in order), `name` (a variant's name) and `from_name` (the variant of a name).
macro_rules! text_names {
    ($t:ident { $($v:ident => $s:literal),+ $(,)? }) => {
        impl $t {
            /// Every variant, in order.
            pub const ALL: [$t; [$($s),+].len()] = [$($t::$v),+];
            /// The text name.
            pub fn name(self) -> &'static str {
                match self {
                    $($t::$v => $s),+
                }
            }
            /// Parses a text name.
            pub fn from_name(s: &str) -> Option<$t> {
                $t::ALL.into_iter().find(|v| v.name() == s)
            }
        }
    };
}

pub mod autodiff;
pub mod checkpoint;
pub mod compile;
pub mod cost;
pub mod ir;
pub mod model;
pub mod pass;
pub mod plan;
pub mod rewrite;
pub mod schedule;
pub mod search;
pub mod shard;
pub mod train;
