//! An opened model: the GGUF mapping (one file or a split set) and the spec derived from
//! it, shared (behind an `Arc`) by every stage and window of one process so the file is
//! mapped once.

use std::ops::Range;
use std::path::Path;

use crate::gguf::{GgufFile, GgufMeta, TensorInfo};
use crate::model::ModelSpec;
use crate::Result;

#[derive(Debug)]
pub struct ModelFile {
    pub gguf: GgufFile,
    pub spec: ModelSpec,
    /// Computed on first use: the ring handshake, every re-planning gathering and the
    /// profile cache key all ask for it, and it reads pages of every tensor.
    fingerprint: std::sync::OnceLock<String>,
}

impl ModelFile {
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile> {
        let gguf = GgufFile::open(path.as_ref())?;
        let spec = ModelSpec::from_gguf(&gguf)?;
        Ok(ModelFile { gguf, spec, fingerprint: std::sync::OnceLock::new() })
    }

    /// Opens a file whose fingerprint is known from elsewhere: a worker's sparse copy of
    /// the head's model holds only its windows, so sampling its tensors would not give
    /// the head's fingerprint, which its verified manifest vouches for.
    pub fn open_as(path: impl AsRef<Path>, fingerprint: String) -> Result<ModelFile> {
        let file = Self::open(path)?;
        let _ = file.fingerprint.set(fingerprint);
        Ok(file)
    }
}

/// The tensors a stage of `windows` reads when it holds neither the embeddings nor the
/// output layer (a worker's stage): every tensor of those layers, and the rope-frequency
/// tensor llama 3 shares between layers. What `weights::bind` binds for such a stage is
/// among these; a worker that has these bytes has all it reads.
pub fn window_tensors<'a>(meta: &'a GgufMeta, windows: &[Range<usize>]) -> Vec<&'a TensorInfo> {
    let layer_of = |name: &str| name.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok();
    meta.tensors()
        .iter()
        .filter(|t| match layer_of(&t.name) {
            Some(l) => windows.iter().any(|w| w.contains(&l)),
            None => t.name == "rope_freqs.weight" && windows.iter().any(|w| !w.is_empty()),
        })
        .collect()
}

/// Bytes sampled from each end of every tensor for the fingerprint: enough to tell two
/// files with equal headers apart (a re-quantisation, other random weights) while reading
/// only two pages per tensor.
const FINGERPRINT_SAMPLE: usize = 4096;

impl ModelFile {
    /// A content fingerprint (SHA-256, hex) that ring members compare at the handshake so
    /// every device runs the same model: the model's length, every file's header and the
    /// first and last bytes of each tensor.
    pub fn fingerprint(&self) -> String {
        self.fingerprint.get_or_init(|| self.compute_fingerprint()).clone()
    }

    fn compute_fingerprint(&self) -> String {
        fingerprint_of(&self.gguf)
    }
}

/// [`ModelFile::fingerprint`] of any GGUF, also one of an architecture the engine does not
/// run itself (an embedding model).
pub fn fingerprint_of(gguf: &GgufFile) -> String {
    {
        use sha2::{Digest, Sha256};
        let bytes = gguf.bytes();
        let mut h = Sha256::new();
        h.update((bytes.len() as u64).to_le_bytes());
        // Every part's header (one for a model in one file): a split set and the same
        // model joined into one file are different files to ship, with different offsets.
        for part in gguf.parts() {
            let header = part.base() as usize..(part.base() + part.header_len()) as usize;
            h.update(&bytes[header.start.min(bytes.len())..header.end.min(bytes.len())]);
        }
        for t in gguf.meta().tensors() {
            let data = gguf.tensor_bytes(t);
            let n = data.len().min(FINGERPRINT_SAMPLE);
            h.update(&data[..n]);
            h.update(&data[data.len() - n..]);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}
