//! "Did you mean": the closest known names to an unknown one.

/// Up to `n` candidates close to `asked` (normalised Damerau-Levenshtein similarity, plus
/// substring matches so `ocr` finds `dots.ocr`), best first.
pub fn closest(asked: &str, candidates: &[String], n: usize) -> Vec<String> {
    let a = asked.to_lowercase();
    let mut scored: Vec<(f64, &String)> = candidates
        .iter()
        .map(|c| {
            let cl = c.to_lowercase();
            let mut s = strsim::normalized_damerau_levenshtein(&a, &cl);
            if a.len() >= 3 && (cl.contains(&a) || a.contains(&cl)) {
                s = s.max(0.75);
            }
            (s, c)
        })
        .filter(|(s, _)| *s >= 0.5)
        .collect();
    scored.sort_by(|x, y| y.0.total_cmp(&x.0).then_with(|| x.1.cmp(y.1)));
    scored.dedup_by(|x, y| x.1 == y.1);
    scored.into_iter().take(n).map(|(_, c)| c.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_typos_and_substrings_not_noise() {
        let c = vec!["dots.ocr".to_string(), "demo-chat".to_string(), "svc-ocr".to_string()];
        assert_eq!(closest("dots-ocr", &c, 3)[0], "dots.ocr");
        assert_eq!(closest("demo_chat", &c, 1), vec!["demo-chat"]);
        assert!(closest("ocr", &c, 3).contains(&"dots.ocr".to_string()));
        assert!(closest("zzzzzzzz", &c, 3).is_empty());
    }
}
