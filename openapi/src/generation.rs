//! What chat and text completions share: stop sequences, stream options, why a choice
//! finished, token usage, and the constant `object` tags of OpenAI's responses.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The lowest log-probability hearth reports. JSON has no `-Infinity` (serde_json would
/// write `null`, which clients reject), so, like OpenAI, impossible tokens get this value.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// Defines a one-value enum for a field whose JSON value is fixed (`"object": "list"`),
/// so the schema says exactly which string is sent and a wrong one fails to parse.
macro_rules! constant_tag {
    // `tt`, not `literal`: a `literal` fragment reaches utoipa's derive wrapped in an
    // invisible group, and utoipa then misses the rename.
    ($(#[$doc:meta])* $name:ident :: $variant:ident = $value:tt) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, ToSchema)]
        pub enum $name {
            #[default]
            #[serde(rename = $value)]
            $variant,
        }
    };
}
pub(crate) use constant_tag;

constant_tag!(
    /// Always `"list"`.
    ListObject::List = "list"
);

/// One stop sequence or a list of them; generation ends before the first one produced, and
/// the stop sequence itself is not part of the output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    /// A single stop sequence.
    One(String),
    /// Several stop sequences (OpenAI allows at most 4).
    Many(Vec<String>),
}

impl Stop {
    /// The stop sequences as one slice, whichever form the client sent.
    pub fn as_slice(&self) -> &[String] {
        match self {
            Stop::One(s) => std::slice::from_ref(s),
            Stop::Many(v) => v,
        }
    }

    /// The stop sequences as an owned list.
    pub fn to_vec(&self) -> Vec<String> {
        self.as_slice().to_vec()
    }
}

/// Options for a streamed response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send one more chunk before `data: [DONE]` with empty `choices` and the token usage of
    /// the whole request; every other chunk then carries `"usage": null`.
    #[serde(default)]
    #[schema(default = false)]
    pub include_usage: bool,
}

/// Why a choice stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its answer or produced a stop sequence.
    Stop,
    /// The token limit (`max_tokens`, `max_completion_tokens` or the context) was reached.
    Length,
    /// The model called one or more tools.
    ToolCalls,
    /// Content was withheld by a filter (hearth has none; listed for client compatibility).
    ContentFilter,
}

/// Token counts of one request, over all its choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Tokens in the prompt (counted once, however many choices were generated).
    pub prompt_tokens: u32,
    /// Tokens generated, summed over all choices.
    pub completion_tokens: u32,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: u32,
    /// Details of the prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Usage with the total filled in.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: None,
        }
    }
}

/// Details of the prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV cache was reused from an earlier request (prompt caching).
    pub cached_tokens: u32,
}

/// Serde glue for a chunk's `usage`, which has three states on the wire: absent (the client
/// did not ask for usage), `null` (it did, and this is not the last chunk), or an object.
/// Used with `default` and `skip_serializing_if = "Option::is_none"`.
pub(crate) mod present_or_null {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(
        value: &Option<Option<T>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(inner) => inner.serialize(serializer),
            None => serializer.serialize_none(),
        }
    }

    // Only called when the field is present, so a present `null` becomes `Some(None)`.
    pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Option<T>>, D::Error> {
        Option::<T>::deserialize(deserializer).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        let one: Stop = serde_json::from_value(json!("\n")).unwrap();
        assert_eq!(one.as_slice(), ["\n".to_string()]);
        let many: Stop = serde_json::from_value(json!(["a", "b"])).unwrap();
        assert_eq!(many.to_vec(), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn finish_reasons_are_snake_case() {
        assert_eq!(json!(FinishReason::ToolCalls), json!("tool_calls"));
        assert_eq!(json!(FinishReason::Length), json!("length"));
        assert_eq!(json!(FinishReason::ContentFilter), json!("content_filter"));
    }

    #[test]
    fn usage_omits_details_it_does_not_have() {
        assert_eq!(
            json!(Usage::new(5, 7)),
            json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12})
        );
        let cached = Usage {
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: 4 }),
            ..Usage::new(5, 7)
        };
        assert_eq!(
            json!(cached)["prompt_tokens_details"],
            json!({"cached_tokens": 4})
        );
    }
}
