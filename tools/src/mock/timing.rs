//! The engine mode's step-time model: a roofline of one GPU serving a dense ~8B model, of a
//! different form from the filter's predictor (a polynomial in uncached tokens plus one in KV
//! fill), so that a router is not graded against its own formula.
//!
//! The simulated engine is Llama-3.1-8B in bf16 on one H100 SXM; the constants are those
//! published figures:
//!
//! * the model (Llama-3.1-8B `config.json`): 32 layers, hidden size 4,096, 32 query and 8 KV
//!   heads of 128 dims, MLP width 14,336, vocabulary 128,256. The matmuls every token goes
//!   through hold [`LINEAR_PARAMS`] = 32 x (4,096 x (4,096 + 2 x 1,024 + 4,096) + 3 x 4,096 x
//!   14,336) = 6.98e9 parameters; the lm_head (4,096 x 128,256 = 0.53e9) runs on the sampled
//!   positions only and the embedding table is a lookup, so neither is in the per-token FLOPs
//!   (the lm_head's, one position per sequence, would only count in decode steps, which are
//!   memory-bound); the weights read every step are the matmuls' and the lm_head's in bf16,
//!   [`WEIGHT_BYTES`] = 15.0 GB (of the 16.1 GB checkpoint);
//! * the KV cache: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = [`KV_BYTES_PER_TOKEN`]
//!   = 128 KiB per token;
//! * the GPU (NVIDIA H100 SXM datasheet): 989.4 TFLOP/s dense bf16, 3.35 TB/s of HBM3. Prefill
//!   runs at [`COMPUTE_EFFICIENCY`] = 65% of that peak: what cuBLAS bf16 GEMMs of thousands of
//!   rows and FlashAttention-3 (up to 740 TFLOP/s, 75%, in its paper) sustain. End-to-end MFU
//!   figures of 40-50% include the per-step overhead and memory-bound phases, which are
//!   modelled separately here; 45% on the compute term too would put an 8,192-token prefill
//!   step at ~300 ms, against the ~170 ms the benchmarks were tuned with. Memory streams at
//!   [`MEMORY_EFFICIENCY`] = 80% of the HBM bandwidth (what memory-bound decode kernels
//!   typically reach);
//! * a fixed [`STEP_OVERHEAD_MS`] = 3 ms per step: scheduling, input preparation, kernel
//!   launches and sampling in vLLM's CPU loop.
//!
//! A step is a set of [`Chunk`]s: each prefill chunk computes `tokens` new tokens of a sequence
//! after `context` tokens already in its KV cache (its cached prefix, device or host tier, and its
//! earlier chunks); each decoding sequence is a chunk of one token after its whole context. Then
//!
//! * linear FLOPs = 2 x [`LINEAR_PARAMS`] x sum of chunk tokens;
//! * attention FLOPs = sum over chunks of 4 x [`LAYERS`] x [`HIDDEN`] x tokens x (context +
//!   tokens / 2): the chunk's tokens attend to every earlier token of their sequence, the cached
//!   prefix included (a long cached prefix still costs attention work, unlike in a polynomial of
//!   uncached tokens), and causally to each other;
//! * bytes = [`WEIGHT_BYTES`] (the weights, read once per step) + [`KV_BYTES_PER_TOKEN`] x sum
//!   over chunks of (context + tokens) (each sequence's KV read, the new tokens' written);
//! * step ms = [`STEP_OVERHEAD_MS`] + max(FLOPs / (peak x [`COMPUTE_EFFICIENCY`]), bytes /
//!   (bandwidth x [`MEMORY_EFFICIENCY`])): decodes riding along a large prefill chunk are nearly
//!   free (the step is compute-bound), a decode-only step costs the weights' and the contexts'
//!   reads;
//! * plus, for the host-tier hits the step reloads, `host_reload_weight` (0.25) of a new token's
//!   linear-layer time each (0.25 x 21.7 us: 128 KiB over ~24 GB/s, a PCIe copy that precedes
//!   the step's forward pass, so it adds to the roofline rather than hiding under it).
//!
//! At speedup 1 (the unit tests pin these): an 8,192-token prefill step from an empty context
//! 208 ms, 1,024 tokens 25.7 ms; a decode-only step of 1 / 16 / 64 sequences of 1,024 tokens 8.6 /
//! 9.4 / 11.8 ms. The engine divides the step time by `--speedup`, multiplies it by `slowdown`
//! (a CPU device) and by a [`Jitter`] factor of mean 1 (`--jitter`).

use crate::util::splitmix64;

/// Transformer layers.
pub const LAYERS: f64 = 32.0;
/// Hidden size (32 query heads x 128 dims).
pub const HIDDEN: f64 = 4096.0;
/// Parameters of the matmuls every token goes through: 32 layers x (q 4,096 x 4,096, k and v
/// 4,096 x 1,024, o 4,096 x 4,096, gate, up and down 3 x 4,096 x 14,336).
pub const LINEAR_PARAMS: f64 = 6_979_321_856.0;
/// The lm_head (4,096 x 128,256): read every step, computed for the sampled positions only.
pub const LM_HEAD_PARAMS: f64 = 525_336_576.0;
/// Weight bytes read per step: the matmuls and the lm_head in bf16.
pub const WEIGHT_BYTES: f64 = 2.0 * (LINEAR_PARAMS + LM_HEAD_PARAMS);
/// KV bytes per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes.
pub const KV_BYTES_PER_TOKEN: f64 = 131_072.0;
/// H100 SXM dense bf16 peak, FLOP/s.
pub const PEAK_FLOPS: f64 = 989.4e12;
/// The share of [`PEAK_FLOPS`] large prefill GEMMs and attention sustain.
pub const COMPUTE_EFFICIENCY: f64 = 0.65;
/// H100 SXM HBM3 bandwidth, bytes/s.
pub const HBM_BYTES_PER_S: f64 = 3.35e12;
/// The share of [`HBM_BYTES_PER_S`] a step's weight and KV reads reach.
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// Fixed CPU / launch / sampling time of every step, ms.
pub const STEP_OVERHEAD_MS: f64 = 3.0;
/// Context tokens per sequence when a KV fill is priced as a decode step
/// ([`decode_fill_ms`]): the fill is held by sequences of this many tokens.
pub const FILL_SEQUENCE_TOKENS: f64 = 2048.0;

/// New tokens of one sequence computed in a step, after `context` tokens already in its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub context: usize,
    pub tokens: usize,
}

/// What one engine step computes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepWork {
    /// Prefill chunks, and decoding sequences as chunks of one token.
    pub chunks: Vec<Chunk>,
    /// Host-tier tokens reloaded, already weighted (`host_reload_weight` x tokens): each adds a
    /// new token's linear-layer time, outside the roofline.
    pub reload_tokens: f64,
}

/// Attention FLOPs of `tokens` new tokens after `context` earlier ones of their sequence.
fn attention_flops(context: f64, tokens: f64) -> f64 {
    4.0 * LAYERS * HIDDEN * tokens * (context.max(0.0) + tokens / 2.0)
}

/// The FLOP/s the compute term runs at.
const EFFECTIVE_FLOPS: f64 = PEAK_FLOPS * COMPUTE_EFFICIENCY;

/// A new token's linear-layer time, ms (the unit of a host-tier reload).
pub fn linear_token_ms() -> f64 {
    2.0 * LINEAR_PARAMS / EFFECTIVE_FLOPS * 1000.0
}

/// The roofline: overhead + max(compute, memory) of a step whose matmuls see `linear_tokens`,
/// with `attention` FLOPs and `kv_tokens` tokens of KV read or written (ms, speedup 1).
fn roofline_ms(linear_tokens: f64, attention: f64, kv_tokens: f64) -> f64 {
    let flops = 2.0 * LINEAR_PARAMS * linear_tokens + attention;
    let bytes = WEIGHT_BYTES + KV_BYTES_PER_TOKEN * kv_tokens;
    let compute_ms = flops / EFFECTIVE_FLOPS * 1000.0;
    let memory_ms = bytes / (HBM_BYTES_PER_S * MEMORY_EFFICIENCY) * 1000.0;
    STEP_OVERHEAD_MS + compute_ms.max(memory_ms)
}

impl StepWork {
    pub fn is_empty(&self) -> bool {
        self.chunks.iter().all(|c| c.tokens == 0) && self.reload_tokens <= 0.0
    }

    /// The step's time in ms at speedup 1 (0 for no work).
    pub fn ms(&self) -> f64 {
        if self.is_empty() {
            return 0.0;
        }
        let (mut tokens, mut attention, mut kv_tokens) = (0.0, 0.0, 0.0);
        for c in &self.chunks {
            let (ctx, n) = (c.context as f64, c.tokens as f64);
            tokens += n;
            attention += attention_flops(ctx, n);
            kv_tokens += ctx + n;
        }
        roofline_ms(tokens, attention, kv_tokens) + self.reload_tokens.max(0.0) * linear_token_ms()
    }
}

/// A step computing one prefill chunk of `tokens` after `context` tokens of its sequence (ms,
/// speedup 1; 0 for no tokens).
pub fn prefill_step_ms(context: f64, tokens: f64) -> f64 {
    if tokens <= 0.0 {
        return 0.0;
    }
    let context = context.max(0.0);
    roofline_ms(tokens, attention_flops(context, tokens), context + tokens)
}

/// A prefill-only step of `new_tokens` from an empty context (ms, speedup 1; 0 for none).
pub fn prefill_ms(new_tokens: f64) -> f64 {
    prefill_step_ms(0.0, new_tokens)
}

/// `tokens` computed alone after `context` cached tokens, in steps of at most `chunk` (ms,
/// speedup 1): each step's chunk attends to the context before it.
pub fn prefill_in_steps_ms(context: f64, tokens: f64, chunk: f64) -> f64 {
    let chunk = chunk.max(1.0);
    let (mut done, mut ms) = (0.0, 0.0);
    while tokens - done > 0.0 {
        let n = (tokens - done).min(chunk);
        ms += prefill_step_ms(context + done, n);
        done += n;
    }
    ms
}

/// A decode-only step of `seqs` sequences of `context` tokens each (ms, speedup 1).
pub fn decode_step_ms(seqs: usize, context: usize) -> f64 {
    StepWork {
        chunks: vec![Chunk { context, tokens: 1 }; seqs],
        reload_tokens: 0.0,
    }
    .ms()
}

/// A decode-only step at KV fill `u` of a cache of `capacity_tokens`: the fill held by decoding
/// sequences of [`FILL_SEQUENCE_TOKENS`] each (at least one sequence). Linear in `u` (each
/// sequence's compute is far under the weights' read time).
pub fn decode_fill_ms(u: f64, capacity_tokens: f64) -> f64 {
    let context = (u.clamp(0.0, 1.0) * capacity_tokens.max(0.0)).round();
    let seqs = (context / FILL_SEQUENCE_TOKENS).ceil().max(1.0);
    roofline_ms(
        seqs,
        seqs * attention_flops(context / seqs, 1.0),
        context + seqs,
    )
}

/// The seed of a worker's [`Jitter`] from its id.
pub fn jitter_seed(worker_id: &str) -> u64 {
    worker_id
        .bytes()
        .fold(0x6A09_E667_F3BC_C908, |h, b| splitmix64(h ^ u64::from(b)))
}

/// Step-time noise: a lognormal factor exp(sigma Z - sigma^2 / 2) of mean 1 per step (Z standard
/// normal), from a deterministic generator; sigma 0 gives exactly 1 and draws nothing.
#[derive(Debug, Clone)]
pub struct Jitter {
    sigma: f64,
    state: u64,
}

impl Jitter {
    pub fn new(sigma: f64, seed: u64) -> Jitter {
        Jitter {
            sigma: if sigma.is_finite() {
                sigma.max(0.0)
            } else {
                0.0
            },
            state: seed,
        }
    }

    pub fn sigma(&self) -> f64 {
        self.sigma
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        ((splitmix64(self.state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// The next step's factor.
    pub fn factor(&mut self) -> f64 {
        if self.sigma == 0.0 {
            return 1.0;
        }
        // Box-Muller.
        let (u1, u2) = (self.uniform(), self.uniform());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.sigma * z - self.sigma * self.sigma / 2.0).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(x: f64, lo: f64, hi: f64) -> bool {
        (lo..=hi).contains(&x)
    }

    #[test]
    fn calibration_at_speedup_1() {
        // An 8,192-token prefill step from an empty context: compute-bound,
        // 3 + (1.1435e14 + 1.7592e13) FLOPs / 643.1 TFLOP/s = 3 + 205.2 ms.
        let full = prefill_ms(8192.0);
        assert!(within(full, 208.0, 208.4), "{full}");
        assert!(
            within(prefill_ms(1024.0), 25.6, 25.7),
            "{}",
            prefill_ms(1024.0)
        );
        // Short chunks are memory-bound: the weights' read, 15.0 GB / 2.68 TB/s = 5.6 ms.
        assert!(within(prefill_ms(64.0), 8.6, 8.7), "{}", prefill_ms(64.0));
        assert_eq!(prefill_ms(0.0), 0.0);
        // Decode-only steps of 1 / 16 / 64 sequences of 1,024 tokens.
        let d1 = decode_step_ms(1, 1024);
        let d16 = decode_step_ms(16, 1024);
        let d64 = decode_step_ms(64, 1024);
        assert!(within(d1, 8.64, 8.66), "{d1}");
        assert!(within(d16, 9.39, 9.41), "{d16}");
        assert!(within(d64, 11.78, 11.82), "{d64}");
        // 256 sequences of 4,096 tokens: 137 GB of KV, 56 ms.
        let big = decode_step_ms(256, 4096);
        assert!(within(big, 59.8, 60.0), "{big}");
    }

    #[test]
    fn a_cached_prefix_costs_attention_work() {
        // 1,024 new tokens after 16,384 cached ones: 524,288 x 1,024 x 16,384 more attention
        // FLOPs (+8.8e12, 13.7 ms).
        let cold = prefill_step_ms(0.0, 1024.0);
        let warm = prefill_step_ms(16384.0, 1024.0);
        assert!(within(warm - cold, 13.6, 13.75), "{cold} {warm}");
        // The step of a StepWork agrees with the helpers.
        let work = StepWork {
            chunks: vec![Chunk {
                context: 16384,
                tokens: 1024,
            }],
            reload_tokens: 0.0,
        };
        assert!((work.ms() - warm).abs() < 1e-9);
        // A reload adds its weighted tokens' linear time, even to a memory-bound step.
        let small = |reload_tokens| {
            StepWork {
                chunks: vec![Chunk {
                    context: 48,
                    tokens: 16,
                }],
                reload_tokens,
            }
            .ms()
        };
        assert!((small(0.25 * 48.0) - small(0.0) - 12.0 * linear_token_ms()).abs() < 1e-9);
        assert!(
            within(linear_token_ms(), 0.0217, 0.0218),
            "{}",
            linear_token_ms()
        );
        assert!(StepWork::default().is_empty());
        assert_eq!(StepWork::default().ms(), 0.0);
        // Decodes riding along a large prefill chunk add nearly nothing (compute-bound).
        let mut mixed = StepWork {
            chunks: vec![Chunk {
                context: 0,
                tokens: 8192,
            }],
            reload_tokens: 0.0,
        };
        mixed.chunks.extend(vec![
            Chunk {
                context: 2048,
                tokens: 1
            };
            32
        ]);
        let extra = mixed.ms() - prefill_ms(8192.0);
        assert!(within(extra, 0.7, 0.9), "{extra}");
    }

    #[test]
    fn steps_and_fills() {
        // 20,000 tokens in 8,192-token steps: each step attends to the ones before.
        let steps = prefill_in_steps_ms(0.0, 20_000.0, 8192.0);
        let by_hand = prefill_step_ms(0.0, 8192.0)
            + prefill_step_ms(8192.0, 8192.0)
            + prefill_step_ms(16384.0, 3616.0);
        assert!((steps - by_hand).abs() < 1e-9);
        assert_eq!(prefill_in_steps_ms(5.0, 0.0, 8192.0), 0.0);
        // The fill of a 1,048,576-token cache: one sequence at 0, 68.7 GB of KV at half.
        assert!((decode_fill_ms(0.0, 1_048_576.0) - decode_step_ms(1, 0)).abs() < 1e-9);
        let half = decode_fill_ms(0.5, 1_048_576.0);
        assert!((half - decode_step_ms(256, 2048)).abs() < 1e-6, "{half}");
        assert!(within(half, 34.2, 34.3), "{half}");
        assert_eq!(decode_fill_ms(2.0, 1000.0), decode_fill_ms(1.0, 1000.0));
    }

    #[test]
    fn jitter_has_mean_one_and_zero_is_off() {
        let mut off = Jitter::new(0.0, 7);
        assert!((0..100).all(|_| off.factor() == 1.0));
        let n = 200_000;
        let mut j = Jitter::new(0.1, jitter_seed("3"));
        let factors: Vec<f64> = (0..n).map(|_| j.factor()).collect();
        let mean = factors.iter().sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.002, "{mean}");
        let logs: Vec<f64> = factors.iter().map(|f| f.ln()).collect();
        let log_mean = logs.iter().sum::<f64>() / n as f64;
        let sd = (logs.iter().map(|l| (l - log_mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!((sd - 0.1).abs() < 0.002, "{sd}");
        // Deterministic per seed, different across workers.
        let mut again = Jitter::new(0.1, jitter_seed("3"));
        assert_eq!(again.factor(), factors[0]);
        let mut other = Jitter::new(0.1, jitter_seed("4"));
        assert_ne!(other.factor(), factors[0]);
        assert_eq!(Jitter::new(f64::NAN, 1).sigma(), 0.0);
        assert_eq!(Jitter::new(-1.0, 1).sigma(), 0.0);
    }
}
