//! Compiles every kernel source and some generated fused kernels to PTX for sm_90 and checks
//! that each expected `.entry` is present.
//!
//! Needs libnvrtc (CUDA 13). Without it each test prints `skipped: libnvrtc not found` and
//! passes, unless `SHARDC_REQUIRE_NVRTC=1` (CI), where it fails. Set up NVRTC with
//! `kernels/ci-nvrtc.sh DIR` and run
//! `LD_LIBRARY_PATH=$(kernels/ci-nvrtc.sh DIR) SHARDC_REQUIRE_NVRTC=1 cargo test -p shardc-kernels`.

use shardc_kernels::{
    compile_cubin, generate_fused_kernel, kernel_source, nvrtc_version, CacheOutcome, FusedBinary,
    FusedExpr, FusedUnary, KernelDType, KernelError, PtxCache, KERNELS,
};

const ARCH: &str = "sm_90";

/// True when NVRTC is usable. Otherwise: panics under `SHARDC_REQUIRE_NVRTC=1`, else prints
/// the skip line and returns false.
fn nvrtc_present() -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("SHARDC_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("SHARDC_REQUIRE_NVRTC=1 but NVRTC cannot be used: {e}");
            }
            eprintln!("skipped: libnvrtc not found ({e})");
            false
        }
    }
}

fn temp_cache() -> (tempfile::TempDir, PtxCache) {
    let dir = tempfile::tempdir().expect("invariant: a temp dir");
    let cache = PtxCache::new(dir.path().join("ptx"));
    (dir, cache)
}

fn assert_targets(ptx: &str, what: &str) {
    assert!(
        ptx.lines().any(|l| l.trim() == format!(".target {ARCH}")),
        "{what}: PTX does not target {ARCH}"
    );
}

#[test]
fn every_kernel_source_compiles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    let (_dir, cache) = temp_cache();
    let (major, minor) = nvrtc_version().expect("invariant: probed above");
    eprintln!("NVRTC {major}.{minor}");
    // Two cores in CI: compile the families on two threads.
    let results: Vec<(&str, Result<Vec<String>, KernelError>)> = std::thread::scope(|s| {
        let chunks: Vec<_> = KERNELS.chunks(KERNELS.len().div_ceil(2)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let cache = &cache;
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|k| {
                            let r = cache.compile(k.file, &k.source(), ARCH, &[]).map(|c| {
                                assert_targets(&c.ptx, k.file);
                                c.entries().into_iter().map(str::to_owned).collect()
                            });
                            (k.file, r)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("invariant: compile thread did not panic"))
            .collect()
    });

    let mut failures = Vec::new();
    for (file, result) in &results {
        let kernel = KERNELS
            .iter()
            .find(|k| k.file == *file)
            .expect("invariant: from KERNELS");
        match result {
            Ok(entries) => {
                for e in kernel.entries {
                    if !entries.iter().any(|x| x == e) {
                        failures.push(format!("{file}: entry `{e}` missing from PTX"));
                    }
                }
                eprintln!("{file}: {} entries ok", kernel.entries.len());
            }
            Err(err) => failures.push(format!("{err}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A kernel family's PTX for sm_90, after [`assemble`], and the checks some families add.
struct Assembled {
    file: &'static str,
    ptx: String,
    cubin: Vec<u8>,
}

/// `family` to PTX for sm_90, every entry point present, and to a CUBIN (assembled by ptxas, so
/// its inline PTX, registers and shared memory are checked too).
fn assemble(family: &str) -> Assembled {
    let k = kernel_source(family).expect("invariant: registered");
    let ptx = PtxCache::disabled()
        .compile(k.file, &k.source(), ARCH, &[])
        .unwrap_or_else(|e| panic!("{e}"));
    for e in k.entries {
        assert!(ptx.has_entry(e), "{}: no `{e}` in the PTX", k.file);
    }
    let cubin = compile_cubin(k.file, &k.source(), ARCH, &[]).unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.starts_with(b"\x7fELF"), "a CUBIN is an ELF image");
    eprintln!("{}: {} bytes of CUBIN", k.file, cubin.len());
    Assembled {
        file: k.file,
        ptx: ptx.ptx,
        cubin,
    }
}

impl Assembled {
    /// mma.cuh's inline PTX: `mma.sync`, `ldmatrix` (plain and `.trans`) and `cp.async`.
    fn assert_tensor_core_instructions(&self) -> &Self {
        for instruction in [
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
            "cp.async.cg.shared.global",
            "cp.async.wait_group",
        ] {
            assert!(
                self.ptx.contains(instruction),
                "{}: no `{instruction}` in the PTX",
                self.file
            );
        }
        self
    }

    /// The PTX of kernel `entry`: from its `.entry` line to the next `.entry` (or the end).
    /// Device functions are inlined, so this holds everything the kernel runs.
    fn entry_ptx(&self, entry: &str) -> &str {
        let line = self
            .ptx
            .lines()
            .find(|l| l.contains(&format!(".entry {entry}(")))
            .unwrap_or_else(|| panic!("{}: no `.entry {entry}`", self.file));
        let start = line.as_ptr() as usize - self.ptx.as_ptr() as usize;
        let body = &self.ptx[start + line.len()..];
        &self.ptx[start..start + line.len() + body.find(".entry ").unwrap_or(body.len())]
    }

    /// Each of `instructions` somewhere in the PTX of kernel `entry`.
    fn assert_entry_uses(&self, entry: &str, instructions: &[&str]) -> &Self {
        let body = self.entry_ptx(entry);
        for instruction in instructions {
            assert!(
                body.contains(instruction),
                "{}: no `{instruction}` in `{entry}`",
                self.file
            );
        }
        self
    }

    /// Some f32 global atomic add (`red` or `atom`).
    fn assert_f32_global_atomic(&self) -> &Self {
        assert!(
            self.ptx
                .lines()
                .any(|l| l.contains(".global.add.f32")
                    && (l.contains("red.") || l.contains("atom."))),
            "{}: no f32 global atomic add in the PTX",
            self.file
        );
        self
    }

    /// ptxas' resource use of `entry`: (registers, stack frame bytes) from the CUBIN's
    /// `.nv.info` ([`cubin_resources`]). A frame of 0 bytes means no spills and no local arrays.
    fn resources(&self, entry: &str) -> (u32, u32) {
        let found = cubin_resources(&self.cubin, entry);
        let (regs, frame) =
            found.unwrap_or_else(|| panic!("{}: no resources of `{entry}`", self.file));
        eprintln!("{entry}: {regs} registers, {frame} bytes of stack frame");
        (regs, frame)
    }

    /// No local memory: no per-thread array is indexed at run time.
    fn assert_no_local_memory(&self) -> &Self {
        assert!(
            !self.ptx.contains(".local"),
            "{}: a local-memory array in the PTX",
            self.file
        );
        self
    }
}

/// Little-endian reads at `at` of a CUBIN (checked: `None` past the end).
fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn le_u64(b: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)).ok()
}

/// The registers (`EIATTR_REGCOUNT`, 0x2f) and stack frame bytes (`EIATTR_FRAME_SIZE`, 0x11)
/// ptxas recorded for function `entry` in the `.nv.info` section of a CUBIN (a 64-bit ELF):
/// records of (format u8, attribute u8, u16), the u16 being the byte length of the data that
/// follows for format 4 (`EIFMT_SVAL`, here a symbol index and a value, u32 each) and the value
/// itself otherwise.
fn cubin_resources(elf: &[u8], entry: &str) -> Option<(u32, u32)> {
    let shoff = le_u64(elf, 0x28)?;
    let (shentsize, shnum) = (le_u16(elf, 0x3a)? as usize, le_u16(elf, 0x3c)? as usize);
    let shstrndx = le_u16(elf, 0x3e)? as usize;
    // (name offset, type, file offset, size, link) of section i
    let section = |i: usize| -> Option<(usize, u32, usize, usize, usize)> {
        let h = shoff + i * shentsize;
        Some((
            le_u32(elf, h)? as usize,
            le_u32(elf, h + 4)?,
            le_u64(elf, h + 24)?,
            le_u64(elf, h + 32)?,
            le_u32(elf, h + 40)? as usize,
        ))
    };
    let c_str = |at: usize| -> Option<&str> {
        let tail = elf.get(at..)?;
        std::str::from_utf8(&tail[..tail.iter().position(|&b| b == 0)?]).ok()
    };
    let names = section(shstrndx)?.2;
    let (mut info, mut symtab) = (None, None);
    for i in 0..shnum {
        let s = section(i)?;
        match (c_str(names + s.0)?, s.1) {
            (".nv.info", _) => info = Some(s),
            (_, 2) => symtab = Some(s), // SHT_SYMTAB
            _ => {}
        }
    }
    let (info, symtab) = (info?, symtab?);
    let strings = section(symtab.4)?.2;
    let symbol =
        |index: u32| c_str(strings + le_u32(elf, symtab.2 + 24 * index as usize)? as usize);
    let (mut regs, mut frame) = (None, None);
    let mut at = info.2;
    while at + 4 <= info.2 + info.3 {
        let (format, attr, len) = (elf[at], elf[at + 1], le_u16(elf, at + 2)? as usize);
        at += 4;
        if format == 4 {
            if len == 8 && symbol(le_u32(elf, at)?)? == entry {
                let value = le_u32(elf, at + 4)?;
                match attr {
                    0x2f => regs = Some(value),
                    0x11 => frame = Some(value),
                    _ => {}
                }
            }
            at += len;
        }
    }
    Some((regs?, frame?))
}

/// `attention_tc` (its `mma.sync`, `ldmatrix` and `cp.async` are inline PTX from mma.cuh) to
/// PTX and to a CUBIN for sm_90: the CUBIN is assembled by ptxas, so a malformed asm string in
/// mma.cuh fails here. Both entries (with and without the lse rows) without spills, the lse
/// costing at most a few registers.
#[test]
fn tensor_core_attention_assembles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    let tc = assemble("attention_tc");
    tc.assert_tensor_core_instructions();
    let (plain, frame) = tc.resources("attention_tc_bf16");
    assert_eq!(frame, 0, "attention_tc_bf16: a stack frame (spills)");
    let (lse, frame) = tc.resources("attention_tc_lse_bf16");
    assert_eq!(frame, 0, "attention_tc_lse_bf16: a stack frame (spills)");
    assert!(
        lse <= plain + 8,
        "attention_tc_lse_bf16: {lse} registers, {plain} without lse"
    );
}

/// `moe_gemm` to PTX and to a CUBIN for sm_90: the `mma.sync`, `ldmatrix` (plain for
/// `routed_gemm_bf16`'s `[n, k]` weights, `.trans` for its `[k, n]` weights and for both of
/// `routed_weight_grad_bf16`'s operands) and `cp.async` of the bf16 GEMMs assemble, and ptxas
/// keeps all four GEMMs within the 128 registers of two 256-thread blocks per SM
/// (`__launch_bounds__(256, 2)`) with no stack frame (no spills).
#[test]
fn routed_gemm_assembles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    let moe = assemble("moe_gemm");
    moe.assert_tensor_core_instructions()
        .assert_no_local_memory()
        // The weight gradient's own: aᵀ and dy both by ldmatrix.trans, double-buffered copies.
        .assert_entry_uses(
            "routed_weight_grad_bf16",
            &[
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.cg.shared.global",
                "cp.async.wait_group 1",
            ],
        );
    for entry in [
        "routed_gemm_bf16",
        "routed_gemm_f32",
        "routed_weight_grad_bf16",
        "routed_weight_grad_f32",
    ] {
        let (regs, frame) = moe.resources(entry);
        assert!(regs <= 128, "{entry}: {regs} registers");
        assert_eq!(frame, 0, "{entry}: a stack frame (spills)");
    }
}

/// The scalar attention and the split-KV decode pair (both on attention.cuh's core) to CUBINs
/// for sm_90, every entry point present.
#[test]
fn attention_decode_assembles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    for family in ["attention", "attention_decode"] {
        assemble(family);
    }
}

/// `attention_bwd` to PTX and to a CUBIN for sm_90 (ptxas accepts its register and shared
/// memory use), with its dQ accumulation as f32 global atomics and dK, dV and the dQ rows in
/// registers.
#[test]
fn attention_backward_assembles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    assemble("attention_bwd")
        .assert_f32_global_atomic()
        .assert_no_local_memory();
}

/// `attention_bwd_tc` (the tensor-core backward on mma.cuh's inline PTX) to PTX and to a CUBIN
/// for sm_90: ptxas assembles its `mma.sync`, `ldmatrix` (plain and `.trans`) and `cp.async`,
/// dQ is added with f32 global atomics, and the fragments and accumulators stay in registers.
#[test]
fn tensor_core_attention_backward_assembles_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    assemble("attention_bwd_tc")
        .assert_tensor_core_instructions()
        .assert_f32_global_atomic()
        .assert_no_local_memory();
}

/// The training kernels to PTX and to CUBINs for sm_90. The optimizer's arithmetic must stay
/// unfused to be bit-identical to the CPU: no floating-point `fma`/`mad` anywhere in optim.cu's
/// PTX. The row caches of norm_grad.cu stay in registers (no `.local`), and embedding_grad
/// accumulates with f32 global atomics.
#[test]
fn training_kernels_assemble_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    let is_float_fma = |l: &str| {
        let op = l.trim_start();
        op.starts_with("fma.") || op.starts_with("mad.rn") || op.starts_with("mad.f")
    };
    let optim = assemble("optim");
    let fused: Vec<&str> = optim.ptx.lines().filter(|l| is_float_fma(l)).collect();
    assert!(fused.is_empty(), "optim.cu contracted: {fused:?}");
    assemble("norm_grad").assert_no_local_memory();
    assemble("grad").assert_f32_global_atomic();
}

/// Inline `asm` is only checked when the PTX is assembled: a CUBIN makes NVRTC run ptxas.
#[test]
fn malformed_inline_ptx_fails_the_cubin_build() {
    if !nvrtc_present() {
        return;
    }
    let good = "extern \"C\" __global__ void good(float* out) { out[0] = 1.0f; }\n";
    let cubin = compile_cubin("good.cu", good, ARCH, &[]).unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.starts_with(b"\x7fELF"), "a CUBIN is an ELF image");
    let src = "extern \"C\" __global__ void bad(float* out) {\n    \
               asm volatile(\"mma.sync.aligned.m16n8k17.row.col.f32.bf16.bf16.f32 {%0}, {%0}, {%0}, {%0};\" : \"+f\"(out[0]));\n}\n";
    match compile_cubin("bad_asm.cu", src, ARCH, &[]) {
        Err(KernelError::Compile { kernel, log, .. }) => {
            assert_eq!(kernel, "bad_asm.cu");
            assert!(log.contains("m16n8k17"), "{log}");
            eprintln!("{log}");
        }
        other => panic!("expected a compile error from ptxas, got {other:?}"),
    }
}

fn sample_fused() -> Vec<(&'static str, FusedExpr)> {
    let x = FusedExpr::input;
    vec![
        ("swiglu", FusedExpr::unary(FusedUnary::Silu, x(0)) * x(1)),
        (
            "bias_gelu_erf",
            FusedExpr::unary(FusedUnary::GeluErf, x(0) + x(1)),
        ),
        (
            "everything",
            FusedExpr::binary(
                FusedBinary::Div,
                FusedExpr::binary(
                    FusedBinary::Sub,
                    FusedExpr::unary(
                        FusedUnary::Exp,
                        FusedExpr::unary(FusedUnary::Neg, FusedExpr::scale(x(2), 0.5)),
                    ),
                    FusedExpr::unary(
                        FusedUnary::Relu,
                        FusedExpr::unary(FusedUnary::GeluTanh, x(0)),
                    ),
                ),
                FusedExpr::constant(1e-6) + x(1),
            ),
        ),
        ("constant", FusedExpr::constant(f32::INFINITY)),
    ]
}

#[test]
fn generated_fused_kernels_compile_for_sm90() {
    if !nvrtc_present() {
        return;
    }
    let (_dir, cache) = temp_cache();
    for (label, expr) in sample_fused() {
        for dtype in KernelDType::ALL {
            let name = expr.kernel_name(dtype);
            let src = generate_fused_kernel(&name, &expr, dtype);
            let file = format!("{label}_{dtype}.cu");
            let ptx = cache
                .compile(&file, &src, ARCH, &[])
                .unwrap_or_else(|e| panic!("{file} ({expr}):\n{e}"));
            assert_targets(&ptx.ptx, &file);
            assert_eq!(ptx.entries(), vec![name.as_str()], "{file}");
        }
    }
}

#[test]
fn second_compile_hits_the_cache() {
    if !nvrtc_present() {
        return;
    }
    let (_dir, cache) = temp_cache();
    let k = shardc_kernels::kernel_source("cast").expect("invariant: registered");
    let first = cache
        .compile(k.file, &k.source(), ARCH, &[])
        .expect("compiles");
    assert_eq!(first.cache, CacheOutcome::Stored);
    let second = cache
        .compile(k.file, &k.source(), ARCH, &[])
        .expect("compiles");
    assert_eq!(second.cache, CacheOutcome::Hit);
    assert_eq!(first.ptx, second.ptx);
    assert_eq!(first.key, second.key);
    // Different options: a different entry.
    let third = cache
        .compile(k.file, &k.source(), ARCH, &["--fmad=false"])
        .expect("compiles");
    assert_ne!(third.key, first.key);
    assert_eq!(third.cache, CacheOutcome::Stored);
    // -lineinfo is always passed: the PTX carries file/line debug info.
    assert!(first.ptx.contains(".file"), "no line info in PTX");
}

#[test]
fn compile_error_carries_log_and_excerpt() {
    if !nvrtc_present() {
        return;
    }
    let src =
        "extern \"C\" __global__ void broken(float* out) {\n    out[0] = undefined_fn(1.0f);\n}\n";
    let err = PtxCache::disabled()
        .compile("broken.cu", src, ARCH, &[])
        .expect_err("must not compile");
    match &err {
        KernelError::Compile {
            kernel,
            log,
            source_excerpt,
        } => {
            assert_eq!(kernel, "broken.cu");
            assert!(log.contains("undefined_fn"), "{log}");
            assert!(
                source_excerpt.contains("> 2 |     out[0] = undefined_fn(1.0f);"),
                "{source_excerpt}"
            );
            assert!(
                source_excerpt.starts_with("broken.cu:2: error:"),
                "{source_excerpt}"
            );
        }
        other => panic!("expected a compile error, got {other}"),
    }
    eprintln!("{err}");
}
