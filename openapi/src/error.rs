//! The crate's error ([`WireError`]: a request that parses but breaks a rule) and OpenAI's
//! error envelope ([`ErrorResponse`]), which every failed request receives.
//!
//! HTTP status codes are not chosen here: the server maps errors to statuses in one place.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Why a well-formed request was refused before any work was done. Both kinds are the
/// client's fault (a 400 in the server) and name the offending parameter with OpenAI's path
/// syntax (`messages[2].content[0].type`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A parameter's value is out of range or inconsistent with another parameter.
    #[error("{message}")]
    InvalidParameter {
        /// The parameter's path in the request.
        param: String,
        /// What is wrong, for the client to read.
        message: String,
    },
    /// A valid OpenAI parameter or value that hearth does not implement.
    #[error("{message}")]
    Unsupported {
        /// The parameter's path in the request.
        param: String,
        /// What is not supported, for the client to read.
        message: String,
    },
}

impl WireError {
    /// An out-of-range or inconsistent `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        WireError::InvalidParameter { param: param.into(), message: message.into() }
    }

    /// The offending parameter's path.
    pub fn param(&self) -> &str {
        match self {
            WireError::InvalidParameter { param, .. } | WireError::Unsupported { param, .. } => {
                param
            }
        }
    }

    /// The message for the client.
    pub fn message(&self) -> &str {
        match self {
            WireError::InvalidParameter { message, .. }
            | WireError::Unsupported { message, .. } => message,
        }
    }

    /// The envelope's machine-readable `code`, as OpenAI spells it.
    pub fn code(&self) -> &'static str {
        match self {
            WireError::InvalidParameter { .. } => "invalid_value",
            WireError::Unsupported { .. } => "unsupported_parameter",
        }
    }
}

/// The error `type` OpenAI uses for every refused request.
pub const INVALID_REQUEST_ERROR: &str = "invalid_request_error";

/// OpenAI's error envelope: the body of every non-2xx response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    /// The error.
    pub error: ErrorBody,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// A human-readable explanation.
    pub message: String,
    /// The error's class, e.g. `invalid_request_error`, `authentication_error`,
    /// `not_found_error`, `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request parameter at fault, if one is.
    #[schema(required = true)]
    pub param: Option<String>,
    /// A machine-readable code, e.g. `context_length_exceeded`, `invalid_api_key`,
    /// `model_not_found`.
    #[schema(required = true)]
    pub code: Option<String>,
}

impl ErrorResponse {
    /// An envelope with neither `param` nor `code`.
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorResponse {
            error: ErrorBody {
                message: message.into(),
                kind: kind.into(),
                param: None,
                code: None,
            },
        }
    }

    /// The same envelope naming the parameter at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.error.param = Some(param.into());
        self
    }

    /// The same envelope with a machine-readable code.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.error.code = Some(code.into());
        self
    }
}

impl From<&WireError> for ErrorResponse {
    fn from(error: &WireError) -> Self {
        ErrorResponse::new(INVALID_REQUEST_ERROR, error.message())
            .with_param(error.param())
            .with_code(error.code())
    }
}

impl From<WireError> for ErrorResponse {
    fn from(error: WireError) -> Self {
        ErrorResponse::from(&error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelope_has_openai_shape_with_nulls() {
        let body = ErrorResponse::new("authentication_error", "Incorrect API key provided.");
        assert_eq!(
            json!(body),
            json!({"error": {"message": "Incorrect API key provided.", "type": "authentication_error",
                             "param": null, "code": null}})
        );
        let back: ErrorResponse = serde_json::from_value(json!(body)).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn wire_errors_fill_the_envelope() {
        let error = WireError::InvalidParameter {
            param: "temperature".into(),
            message: "too hot".into(),
        };
        assert_eq!(error.to_string(), "too hot");
        assert_eq!(
            json!(ErrorResponse::from(error)),
            json!({"error": {"message": "too hot", "type": "invalid_request_error",
                             "param": "temperature", "code": "invalid_value"}})
        );
    }
}
