//! Stage partitioning: layers split over pipeline chunks by cost, or as given.

use super::PipelineError;

/// Splits `costs` (one per layer, in order) into `parts` contiguous stages minimising the most
/// expensive stage, and among those splits the spread (the sum of squared stage costs), so
/// stages that the bottleneck does not constrain are evened out too. Returns layers per stage.
pub fn balance(costs: &[f64], parts: usize) -> Result<Vec<usize>, PipelineError> {
    let n = costs.len();
    if parts == 0 || parts > n {
        return Err(PipelineError::Invalid(format!(
            "cannot split {n} layers into {parts} pipeline stages (each stage needs a layer)"
        )));
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |a, &c| {
            *a += c;
            Some(*a)
        }))
        .collect();
    let total = prefix[n].max(f64::MIN_POSITIVE);
    // (bottleneck, sum of squares) of the best split of the first i items into k stages.
    let better = |a: (f64, f64), b: (f64, f64)| {
        let tol = 1e-9 * total;
        a.0 < b.0 - tol || (a.0 <= b.0 + tol && a.1 < b.1 - tol * tol)
    };
    let inf = (f64::INFINITY, f64::INFINITY);
    let mut best = vec![vec![inf; n + 1]; parts + 1];
    let mut from = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = (0.0, 0.0);
    for k in 1..=parts {
        for i in k..=n - (parts - k) {
            for j in (k - 1)..i {
                let prev = best[k - 1][j];
                if prev.0.is_infinite() {
                    continue;
                }
                let c = prefix[i] - prefix[j];
                let cand = (prev.0.max(c), prev.1 + c * c);
                if better(cand, best[k][i]) {
                    best[k][i] = cand;
                    from[k][i] = j;
                }
            }
        }
    }
    let mut out = vec![0; parts];
    let mut i = n;
    for k in (1..=parts).rev() {
        let j = from[k][i];
        out[k - 1] = i - j;
        i = j;
    }
    Ok(out)
}

/// Parses and checks a `--stage-layers 9,8,8,7` override.
pub fn parse_stage_layers(
    text: &str,
    layers: usize,
    parts: usize,
) -> Result<Vec<usize>, PipelineError> {
    let v: Vec<usize> = text
        .split(',')
        .map(|x| {
            x.trim().parse::<usize>().map_err(|_| {
                PipelineError::Invalid(format!("--stage-layers: `{x}` is not a number"))
            })
        })
        .collect::<Result<_, _>>()?;
    if v.len() != parts {
        return Err(PipelineError::Invalid(format!(
            "--stage-layers gives {} stages, the pipeline has {parts} (pp × virtual stages)",
            v.len()
        )));
    }
    if let Some(i) = v.iter().position(|&n| n == 0) {
        return Err(PipelineError::Invalid(format!(
            "--stage-layers {text}: stage {i} has no layers (each needs at least one)"
        )));
    }
    let sum = v.iter().fold(0u128, |s, &n| s + n as u128);
    if sum != layers as u128 {
        return Err(PipelineError::Invalid(format!(
            "--stage-layers {text} covers {sum} layers (each stage ≥ 1), the model has {layers}"
        )));
    }
    Ok(v)
}
