//! The sampling fields chat and text completions share, declared once: the request structs
//! are written through `with_sampling_fields!`, which adds these fields (with their
//! documentation and schema bounds) and a `sampling()` view of them. Validation and the
//! server read them through that view, so no list of them is written twice.

use std::collections::BTreeMap;

/// The shared sampling fields of a request, as sent (`None`: the server's default).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingOptions<'a> {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<&'a BTreeMap<String, f32>>,
}

/// Declares a request struct with the shared sampling fields after its own.
macro_rules! with_sampling_fields {
    ($(#[$meta:meta])* pub struct $name:ident { $($fields:tt)* }) => {
        $(#[$meta])*
        pub struct $name {
            $($fields)*
            /// Sampling temperature; 0 picks the most likely token every time. Default 1.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(minimum = 0, maximum = 2)]
            pub temperature: Option<f32>,
            /// Nucleus sampling: keep the smallest set of tokens whose probabilities add up to this.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(exclusive_minimum = 0, maximum = 1)]
            pub top_p: Option<f32>,
            /// Penalises tokens that already appeared at all, in -2..=2.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(minimum = -2, maximum = 2)]
            pub presence_penalty: Option<f32>,
            /// Penalises tokens by how often they already appeared, in -2..=2.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(minimum = -2, maximum = 2)]
            pub frequency_penalty: Option<f32>,
            /// Added to the logits of the given tokens: keys are token ids (as strings), values in
            /// -100..=100, where -100 bans a token and 100 forces it.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub logit_bias: Option<BTreeMap<String, f32>>,
            /// hearth extension (as in llama.cpp and vLLM): sample only among the k most likely
            /// tokens; 0 or -1 disables it.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(minimum = -1)]
            pub top_k: Option<i32>,
            /// hearth extension (as in llama.cpp and vLLM): drop tokens whose probability is below
            /// this fraction of the most likely token's.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(minimum = 0, maximum = 1)]
            pub min_p: Option<f32>,
            /// hearth extension (llama.cpp's repetition penalty): divides the logits of recently
            /// seen tokens by this; 1 disables it.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schema(exclusive_minimum = 0)]
            pub repeat_penalty: Option<f32>,
        }

        impl $name {
            /// The shared sampling fields, as sent.
            pub fn sampling(&self) -> $crate::SamplingOptions<'_> {
                $crate::SamplingOptions {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    repeat_penalty: self.repeat_penalty,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    logit_bias: self.logit_bias.as_ref(),
                }
            }
        }
    };
}
