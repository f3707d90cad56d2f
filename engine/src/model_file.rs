//! An opened model: the GGUF mapping and the spec derived from it, shared (behind an
//! `Arc`) by every stage and window of one process so the file is mapped once.

use std::path::Path;

use crate::gguf::GgufFile;
use crate::model::ModelSpec;
use crate::Result;

pub struct ModelFile {
    pub gguf: GgufFile,
    pub spec: ModelSpec,
}

impl ModelFile {
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile> {
        let gguf = GgufFile::open(path.as_ref())?;
        let spec = ModelSpec::from_gguf(&gguf)?;
        Ok(ModelFile { gguf, spec })
    }
}
