//! `GET /v1/models`: the models this server answers to.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::generation::{constant_tag, ListObject};

constant_tag!(
    /// Always `"model"`.
    ModelObject::Model = "model"
);

/// The models this server serves.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: ListObject,
    /// The models.
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// A list of the given models.
    pub fn new(data: Vec<ModelCard>) -> Self {
        ModelList {
            object: ListObject::List,
            data,
        }
    }
}

/// A model that requests may name in `model`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    /// The model's name, to use as `model` in requests.
    #[schema(example = "SmolLM2-135M-Instruct")]
    pub id: String,
    /// Always `model`.
    pub object: ModelObject,
    /// When the model was loaded (or its file written), in Unix seconds.
    pub created: u64,
    /// Who serves it (`hearth`).
    pub owned_by: String,
    /// What it does: `chat`, `completion`, `tools`, `thinking`, or `embeddings` for the
    /// embedding model (hearth extension).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// Tokens per sequence it is served with (hearth extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u64>,
}

impl ModelCard {
    /// A model card.
    pub fn new(id: impl Into<String>, created: u64, owned_by: impl Into<String>) -> Self {
        ModelCard {
            id: id.into(),
            object: ModelObject::Model,
            created,
            owned_by: owned_by.into(),
            capabilities: Vec::new(),
            context_length: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn model_list_has_openai_shape() {
        let list = ModelList::new(vec![ModelCard::new("smol", 5, "hearth")]);
        assert_eq!(
            json!(list),
            json!({"object": "list",
                   "data": [{"id": "smol", "object": "model", "created": 5, "owned_by": "hearth"}]})
        );
        let back: ModelList = serde_json::from_value(json!(list)).unwrap();
        assert_eq!(back, list);
    }
}
