//! Fuzzing of what the server does with a request body before any work: parse into
//! openapi's request types, then `validate`. Bodies are valid chat and text completion
//! requests mutated as clients get them wrong (wrong types, edge numbers, nulls, deep
//! nesting, unicode, huge arrays, unknown fields, broken text; see tests/fuzz_json.rs).
//!
//! Promises checked: nothing panics or stalls; every refusal becomes OpenAI's error
//! envelope with a message, `invalid_request_error` and, for validation, the parameter at
//! fault; a request that passes validation serialises and parses back to itself and passes
//! again, and the accessors the server calls on it answer. `HEARTH_FUZZ_SECS=600` runs it
//! for ten minutes (see docs/robustness.md).

#[path = "../../tests/fuzz_driver.rs"]
mod fuzz;
#[path = "../../tests/fuzz_json.rs"]
mod fuzz_json;

use std::time::Duration;

use fuzz::{shape, Budget};
use fuzz_json::{Body, Endpoint};
use openapi::{parse_logit_bias, ChatCompletionRequest, CompletionRequest, ErrorResponse, Limits, WireError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// Parsing a few megabytes of JSON takes milliseconds.
const STALL: Duration = Duration::from_secs(5);

/// The envelope every refused request gets, checked field by field.
fn assert_envelope(envelope: &ErrorResponse, validation: bool) {
    let v = serde_json::to_value(envelope).expect("envelope serialises");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "param and code must be present: {v}");
    if validation {
        assert!(e["param"].as_str().is_some_and(|p| !p.is_empty()), "a validation error names its parameter: {v}");
        assert!(matches!(e["code"].as_str(), Some("invalid_value" | "unsupported_parameter")), "{v}");
    }
}

/// A message's kind: numbers and quoted names stripped (serde quotes the offending text).
fn message_shape(message: &str) -> String {
    let mut out = String::new();
    for (i, part) in message.split(['`', '\'']).enumerate() {
        out.push_str(if i % 2 == 0 { part } else { "…" });
    }
    shape(&out)
}

/// Parse, validate, and what the server does next with an accepted request.
fn judge<T>(text: &[u8], validate: impl Fn(&T) -> Result<(), WireError>, use_it: impl Fn(&T)) -> String
where
    T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug,
{
    let request: T = match serde_json::from_slice(text) {
        Err(e) => {
            let envelope = ErrorResponse::new("invalid_request_error", format!("invalid JSON body: {e}")).with_code("invalid_json");
            assert_envelope(&envelope, false);
            return format!("parse: {}", message_shape(&e.to_string()));
        }
        Ok(r) => r,
    };
    if let Err(e) = validate(&request) {
        assert_envelope(&ErrorResponse::from(&e), true);
        return format!("invalid {}: {}", shape(e.param()), message_shape(e.message()));
    }
    use_it(&request);
    let again: T = serde_json::to_value(&request)
        .and_then(serde_json::from_value)
        .unwrap_or_else(|e| panic!("an accepted request does not round-trip: {e}"));
    assert_eq!(again, request, "round trip changed the request");
    validate(&again).unwrap_or_else(|e| panic!("the round-tripped request fails validation: {e}"));
    "accepted".into()
}

fn check(body: &Body) -> String {
    let limits = Limits::default();
    let outcome = match body.endpoint {
        Endpoint::Chat => judge(
            &body.text,
            |r: &ChatCompletionRequest| r.validate(&limits),
            |r| {
                let _ = (r.max_new_tokens(), r.choices(), r.include_usage(), r.logprobs_requested());
                let stops = r.stop_sequences();
                assert!(stops.len() <= limits.max_stop, "{} stop sequences passed", stops.len());
                assert!(r.choices() >= 1 && r.choices() <= limits.max_n, "n {}", r.choices());
                r.messages.iter().for_each(|m| drop(m.text()));
                if let Some(bias) = &r.logit_bias {
                    parse_logit_bias(bias).expect("validated logit_bias parses");
                }
            },
        ),
        Endpoint::Completions => judge(
            &body.text,
            |r: &CompletionRequest| r.validate(&limits),
            |r| {
                let _ = (r.max_new_tokens(), r.include_usage(), r.stop_sequences());
                let inputs = r.prompt.inputs();
                assert!(!inputs.is_empty() && inputs.len() <= limits.max_prompts, "{} prompts passed", inputs.len());
                assert!(r.choices() >= 1 && r.choices() <= limits.max_n, "n {}", r.choices());
                if let Some(bias) = &r.logit_bias {
                    parse_logit_bias(bias).expect("validated logit_bias parses");
                }
            },
        ),
    };
    format!("{:?} {outcome}", body.endpoint)
}

#[test]
fn request_parsing_and_validation_survive_hostile_bodies() {
    let seeds = fuzz_json::seeds("m");
    for s in &seeds {
        assert_eq!(check(s), format!("{:?} accepted", s.endpoint), "seed {}", String::from_utf8_lossy(&s.text));
    }
    // Sanity of the envelope check itself on a known refusal.
    let hot: Value = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9});
    let text = serde_json::to_vec(&hot).unwrap();
    assert!(check(&Body { endpoint: Endpoint::Chat, text }).contains("invalid temperature"));
    let report = fuzz::run("openapi-json", &Budget::from_env(1.0), seeds, STALL, fuzz_json::mutate, check);
    assert!(report.outcomes > 20, "the fuzzer reached only {} outcomes: is it mutating?", report.outcomes);
}
