//! Stop strings on streamed text. Text that might be the start of a stop string is held
//! back until it is clear it is not, so a stop string never reaches the client, not even
//! in part.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Adds generated text. Returns the text that is safe to emit, and whether a stop
    /// string was completed (the text after it is dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Text still held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_strings_never_leak_even_when_split_across_tokens() {
        let mut m = StopMatcher::new(vec!["\nUser:".into(), "END".into()]);
        assert_eq!(m.push("Hello"), ("Hello".into(), false));
        assert_eq!(m.push(" there\nU"), (" there".into(), false));
        assert_eq!(m.push("se"), ("".into(), false));
        assert_eq!(m.push("r: more"), ("".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("the EN"), ("the ".into(), false));
        assert_eq!(m.push("TRY"), ("ENTRY".into(), false));
        assert_eq!(m.push("E"), ("".into(), false));
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let mut m = StopMatcher::new(vec!["b".into(), "aé".into()]);
        assert_eq!(m.push("xxaéyb"), ("xx".into(), true));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".into(), false));
        assert_eq!(m.push("?"), ("é?".into(), false));
    }
}
