//! Log-probabilities of the model's next-token distribution (raw logits, before any
//! sampler), as OpenAI reports them.

/// log-softmax of `logits` at `token`, and the `k` most likely tokens with theirs.
pub fn logprobs(logits: &[f32], token: i32, k: usize) -> (f32, Vec<(i32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let lp = |t: usize| logits[t] - log_sum;
    let mut top: Vec<(i32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < k || l > top[top.len() - 1].1 {
                let at = top.partition_point(|&(_, x)| x >= l);
                top.insert(at, (i as i32, l));
                top.truncate(k);
            }
        }
    }
    (lp(token as usize), top.into_iter().map(|(t, _)| (t, lp(t as usize))).collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let (lp, top) = super::logprobs(&logits, 2, 2);
        let total: f32 = logits.iter().map(|&l| (l - 3.0f32).exp()).sum();
        assert!((lp - (2.0 - 3.0 - total.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!(top[0].1 > top[1].1 && top[0].1 < 0.0);
    }
}
