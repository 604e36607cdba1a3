//! The torchrun environment contract: which variables name a rank, and their validation.
//!
//! | variable | meaning | fallbacks |
//! | --- | --- | --- |
//! | `RANK` | global rank, `0 ≤ RANK < WORLD_SIZE` | `OMPI_COMM_WORLD_RANK`, `PMI_RANK` |
//! | `WORLD_SIZE` | number of ranks, ≥ 1 | `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` |
//! | `LOCAL_RANK` | rank within this node | `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`; else `RANK` |
//! | `LOCAL_WORLD_SIZE` | ranks on this node | `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`; else `WORLD_SIZE` |
//! | `MASTER_ADDR` | host of rank 0's rendezvous store | none |
//! | `MASTER_PORT` | its TCP port, 1..=65535 | none |
//!
//! A process is a multi-process rank when `RANK` or `WORLD_SIZE` (or a fallback) is set
//! ([`WorldEnv::detected`]); then `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are
//! required, and an absent or malformed one is a [`LaunchError`] naming it. Under mpirun,
//! pass `-x MASTER_ADDR -x MASTER_PORT`; the rank variables come from Open MPI's own.

use super::LaunchError;
use std::fmt;

/// `RANK`.
pub const RANK: &str = "RANK";
/// `WORLD_SIZE`.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// `LOCAL_RANK`.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// `LOCAL_WORLD_SIZE`.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// `MASTER_ADDR`.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// `MASTER_PORT`.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// `GROUP_RANK` (torchrun's node rank; informational).
pub const GROUP_RANK: &str = "GROUP_RANK";

const RANK_VARS: &[&str] = &[RANK, "OMPI_COMM_WORLD_RANK", "PMI_RANK"];
const SIZE_VARS: &[&str] = &[WORLD_SIZE, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];
const LOCAL_RANK_VARS: &[&str] = &[LOCAL_RANK, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"];
const LOCAL_SIZE_VARS: &[&str] = &[
    LOCAL_WORLD_SIZE,
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
];

/// Who this process is in a multi-process job (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within this node (selects the GPU).
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
}

impl WorldEnv {
    /// Whether this process was started as a rank of a multi-process job: `RANK` or
    /// `WORLD_SIZE` (or an MPI fallback) is set.
    pub fn detected() -> bool {
        WorldEnv::detected_in(|name| std::env::var(name).ok())
    }

    /// [`WorldEnv::detected`] over any variable lookup.
    pub fn detected_in(lookup: impl Fn(&str) -> Option<String>) -> bool {
        RANK_VARS
            .iter()
            .chain(SIZE_VARS)
            .any(|v| lookup(v).is_some())
    }

    /// Reads and validates the process environment.
    pub fn from_env() -> Result<WorldEnv, LaunchError> {
        WorldEnv::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads and validates the variables `lookup` returns (`None`: unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<WorldEnv, LaunchError> {
        let first = |vars: &[&'static str]| -> Option<(&'static str, String)> {
            vars.iter().find_map(|&v| lookup(v).map(|x| (v, x)))
        };
        let number = |vars: &[&'static str],
                      required: bool|
         -> Result<Option<(&'static str, usize)>, LaunchError> {
            match first(vars) {
                None if required => Err(LaunchError::MissingVar { name: vars[0] }),
                None => Ok(None),
                Some((name, value)) => match value.trim().parse::<usize>() {
                    Ok(n) => Ok(Some((name, n))),
                    Err(_) => Err(LaunchError::InvalidVar {
                        name,
                        value,
                        reason: "not a non-negative integer".to_string(),
                    }),
                },
            }
        };
        let invalid = |name: &'static str, value: usize, reason: String| LaunchError::InvalidVar {
            name,
            value: value.to_string(),
            reason,
        };
        let (size_var, world_size) = number(SIZE_VARS, true)?.expect("invariant: required");
        if world_size == 0 {
            return Err(invalid(size_var, 0, "must be at least 1".to_string()));
        }
        let (rank_var, rank) = number(RANK_VARS, true)?.expect("invariant: required");
        if rank >= world_size {
            return Err(invalid(
                rank_var,
                rank,
                format!("must be below {size_var}={world_size}"),
            ));
        }
        let local_world_size = match number(LOCAL_SIZE_VARS, false)? {
            None => world_size,
            Some((name, 0)) => return Err(invalid(name, 0, "must be at least 1".to_string())),
            Some((name, n)) if n > world_size => {
                return Err(invalid(name, n, format!("exceeds {size_var}={world_size}")))
            }
            Some((_, n)) => n,
        };
        let local_rank = match number(LOCAL_RANK_VARS, false)? {
            None => rank % local_world_size,
            Some((name, n)) if n >= local_world_size => {
                return Err(invalid(
                    name,
                    n,
                    format!("must be below the local world size {local_world_size}"),
                ))
            }
            Some((_, n)) => n,
        };
        let master_addr = lookup(MASTER_ADDR)
            .ok_or(LaunchError::MissingVar { name: MASTER_ADDR })?
            .trim()
            .to_string();
        if master_addr.is_empty() {
            return Err(LaunchError::InvalidVar {
                name: MASTER_ADDR,
                value: master_addr,
                reason: "empty host name".to_string(),
            });
        }
        let port = lookup(MASTER_PORT).ok_or(LaunchError::MissingVar { name: MASTER_PORT })?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| LaunchError::InvalidVar {
                name: MASTER_PORT,
                value: port.clone(),
                reason: "not a TCP port (1..=65535)".to_string(),
            })?;
        Ok(WorldEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    /// The variables that describe this rank, as `shardc launch` sets them.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            (RANK, self.rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
        ]
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed).
    pub fn master(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }
}

impl fmt::Display for WorldEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local {} of {}), store {}",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master()
        )
    }
}

/// `host:port`, bracketing IPv6 literals.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<WorldEnv, LaunchError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorldEnv::from_lookup(|k| map.get(k).cloned())
    }

    const BASE: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn with<'a>(over: &[(&'a str, &'a str)], drop: &[&str]) -> Vec<(&'a str, &'a str)> {
        let mut v: Vec<_> = BASE
            .iter()
            .copied()
            .filter(|(k, _)| !drop.contains(k) && !over.iter().any(|(o, _)| o == k))
            .collect();
        v.extend_from_slice(over);
        v
    }

    fn err(over: &[(&str, &str)], drop: &[&str]) -> String {
        env(&with(over, drop)).unwrap_err().to_string()
    }

    #[test]
    fn reads_torchrun_variables() {
        let e = env(BASE).unwrap();
        assert_eq!(
            e,
            WorldEnv {
                rank: 1,
                world_size: 4,
                local_rank: 1,
                local_world_size: 2,
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            }
        );
        assert_eq!(e.master(), "10.0.0.1:29500");
        // Round trip through the variables the launcher sets.
        let vars: Vec<(&str, String)> = e.vars();
        let map: HashMap<&str, String> = vars.into_iter().collect();
        assert_eq!(WorldEnv::from_lookup(|k| map.get(k).cloned()).unwrap(), e);
    }

    #[test]
    fn local_variables_default_to_one_node() {
        let e = env(&with(&[], &["LOCAL_RANK", "LOCAL_WORLD_SIZE"])).unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (1, 4));
    }

    #[test]
    fn open_mpi_fallbacks() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!(e.master(), "[::1]:1234");
        assert!(WorldEnv::detected_in(
            |k| (k == "PMI_SIZE").then(|| "2".into())
        ));
        assert!(!WorldEnv::detected_in(|_| None));
    }

    #[test]
    fn missing_and_invalid_variables_are_named() {
        for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let e = err(&[], &[var]);
            assert!(e.contains(&format!("{var} is not set")), "{e}");
        }
        // (overridden variables, needles of the error)
        type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
        let cases: &[Case] = &[
            (&[("RANK", "abc")], &["RANK=`abc`", "non-negative integer"]),
            (&[("RANK", "-1")], &["RANK=`-1`"]),
            (&[("RANK", "4")], &["RANK=`4`", "below WORLD_SIZE=4"]),
            (&[("WORLD_SIZE", "0")], &["WORLD_SIZE=`0`", "at least 1"]),
            (
                &[("LOCAL_RANK", "2")],
                &["LOCAL_RANK=`2`", "local world size 2"],
            ),
            (
                &[("LOCAL_WORLD_SIZE", "8")],
                &["LOCAL_WORLD_SIZE=`8`", "exceeds"],
            ),
            (&[("MASTER_PORT", "0")], &["MASTER_PORT=`0`", "TCP port"]),
            (&[("MASTER_PORT", "70000")], &["MASTER_PORT=`70000`"]),
            (&[("MASTER_ADDR", " ")], &["MASTER_ADDR", "empty"]),
        ];
        for (over, needles) in cases {
            let e = err(over, &[]);
            for n in *needles {
                assert!(e.contains(n), "`{n}` not in: {e}");
            }
        }
    }
}
