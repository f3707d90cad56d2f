//! Generation: validated requests go into a bounded queue; one batching loop, on its own
//! thread because it owns the pipeline, admits them into sequence slots, runs one batch
//! per step across every active sequence, samples each sequence with its own sampler, and
//! sends token events back. Nothing here knows about HTTP or OpenAI's JSON.

mod batcher;
#[cfg(test)]
mod batcher_tests;
mod logprobs;
mod pipeline;
mod prefix_cache;
mod request;
#[cfg(test)]
mod scripted;
mod speculation;
mod stop;

pub use batcher::{Batcher, BatcherConfig, SubmitError};
pub use pipeline::Pipeline;
pub use prefix_cache::{default_dir as default_prompt_cache_dir, namespace as prompt_cache_namespace, BlockId, PrefixCache, PrefixCacheConfig, BLOCK_TOKENS, STATE_EVERY_BLOCKS};
pub use request::{Event, Finish, GenerationRequest, TokenInfo, TokenLogprob};
pub use speculation::{DraftModel, Proposer};
