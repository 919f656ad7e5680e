//! The serde pass: hand-written visitors that read only the fields routing needs, tracking which
//! field is being read so that a type error names it. With a [`Prefill`] from the fast scan, the
//! token arrays it cut out are taken from there (see the `request` module docs).

use std::cell::Cell;
use std::fmt;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Endpoint, LlmRequest, ParseOptions, RequestError, TokenSpan};
use crate::types::WorkerId;

/// One serde pass over a body that starts with `{`. With `prefill`, the token arrays the fast
/// scan cut out are taken from it (see `super::fast::parse_fast`).
pub(super) fn parse_object(
    body: &[u8],
    endpoint: Endpoint,
    prefill: Option<&Prefill>,
    opts: &ParseOptions,
) -> Result<LlmRequest, RequestError> {
    let ctx = Ctx {
        field: Cell::new("(body)"),
        batched: Cell::new(false),
        over_cap: Cell::new(false),
        prefill,
        opts,
        body_at: body.as_ptr() as usize,
        body_len: body.len(),
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = TopSeed {
        ctx: &ctx,
        endpoint,
    }
    .deserialize(&mut de)
    .and_then(|req| de.end().map(|()| req));
    result.map_err(|e| {
        if ctx.batched.get() {
            return RequestError::BatchedPrompt;
        }
        if ctx.over_cap.get() {
            return RequestError::TooManyItems {
                field: ctx.field.get(),
                max: opts.max_hint_items,
            };
        }
        match e.classify() {
            serde_json::error::Category::Data => RequestError::BadField {
                field: ctx.field.get(),
                detail: e.to_string(),
            },
            _ => RequestError::InvalidJson {
                detail: e.to_string(),
            },
        }
    })
}

/// A token array's ids: read, or where they are in the body (a lazy parse).
pub(super) enum Tokens {
    Ids(Vec<u32>),
    Span(TokenSpan),
}

/// Token arrays cut out by the fast scan, one entry per occurrence of the field in body order,
/// stored reversed: `Some(tokens)` = cut (the copy holds `[]`), `None` = left in the body.
pub(super) struct Prefill {
    pub(super) prompts: Cell<Vec<Option<Tokens>>>,
    pub(super) token_data: Cell<Vec<Option<Tokens>>>,
}

/// Substitutes the next cut array of `queue` for the value the visitor just read. `is_cut_marker`
/// says whether that value is `[]`; a cut must meet one (and only a cut is substituted).
fn take_prefilled<E: de::Error>(
    queue: &Cell<Vec<Option<Tokens>>>,
    is_cut_marker: bool,
) -> Result<Option<Tokens>, E> {
    let mut q = queue.take();
    let next = q.pop();
    queue.set(q);
    match next {
        None => Err(E::custom("fast scan out of step")),
        Some(None) => Ok(None),
        Some(Some(ids)) if is_cut_marker => Ok(Some(ids)),
        Some(Some(_)) => Err(E::custom("fast scan out of step")),
    }
}

/// Parse-wide state: the field being read (for error messages), the batch marker, and the fast
/// pass's cut token arrays.
struct Ctx<'p> {
    field: Cell<&'static str>,
    batched: Cell<bool>,
    /// A hint list went over `opts.max_hint_items` (the error names `field`).
    over_cap: Cell<bool>,
    prefill: Option<&'p Prefill>,
    opts: &'p ParseOptions,
    /// Where the body is in memory, and its length: a borrowed value's offset in it.
    body_at: usize,
    body_len: usize,
}

impl Ctx<'_> {
    /// Where a value borrowed from the body (a [`RawValue`]) is in it.
    fn range_of<E: de::Error>(&self, raw: &RawValue) -> Result<Range<usize>, E> {
        let text = raw.get();
        let start = (text.as_ptr() as usize).wrapping_sub(self.body_at);
        match start.checked_add(text.len()) {
            Some(end) if end <= self.body_len => Ok(start..end),
            _ => Err(E::custom("a value outside the body")),
        }
    }
}

/// Resolves an object key to its index in a fixed list without allocating.
struct KeySeed(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().position(|k| *k == v))
    }
}

const TOP_KEYS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "stream",
    "nvext",
    "max_tokens",
    "max_completion_tokens",
    "priority",
];
/// `NVEXT_KEYS` with their `nvext.` prefix, for error messages (same order).
const NVEXT_FIELDS: [&str; 8] = [
    "nvext.token_data",
    "nvext.backend_instance_id",
    "nvext.dp_rank",
    "nvext.allowed_worker_ids",
    "nvext.required_taints",
    "nvext.preferred_taints",
    "nvext.agent_hints",
    "nvext.lora_name",
];
const NVEXT_KEYS: &[&str] = &[
    "token_data",
    "backend_instance_id",
    "dp_rank",
    "allowed_worker_ids",
    "required_taints",
    "preferred_taints",
    "agent_hints",
    "lora_name",
];

struct TopSeed<'c> {
    ctx: &'c Ctx<'c>,
    endpoint: Endpoint,
}

impl<'de> DeserializeSeed<'de> for TopSeed<'_> {
    type Value = LlmRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<LlmRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TopSeed<'_> {
    type Value = LlmRequest;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LlmRequest, A::Error> {
        let ctx = self.ctx;
        let mut req = LlmRequest::default();
        let mut prompt_tokens: Option<Tokens> = None;
        let mut nvext_tokens: Option<Tokens> = None;
        while let Some(key) = map.next_key_seed(KeySeed(TOP_KEYS))? {
            match key {
                Some(0) => {
                    ctx.field.set("model");
                    req.model = map.next_value()?;
                }
                Some(1) if self.endpoint == Endpoint::Completions => {
                    ctx.field.set("prompt");
                    let prompt = map.next_value_seed(PromptSeed { ctx })?;
                    let mut cut = None;
                    if let Some(prefill) = ctx.prefill {
                        let marker = matches!(&prompt, Prompt::Tokens(ids) if ids.is_empty());
                        cut = take_prefilled(&prefill.prompts, marker)?;
                    }
                    match (cut, prompt) {
                        (Some(tokens), _) => prompt_tokens = Some(tokens),
                        (None, Prompt::Absent) => {}
                        (None, Prompt::Text(chars)) => req.text_chars = chars,
                        (None, Prompt::Tokens(ids)) => prompt_tokens = Some(Tokens::Ids(ids)),
                    }
                }
                Some(2) if self.endpoint == Endpoint::ChatCompletions => {
                    ctx.field.set("messages");
                    req.text_chars = map.next_value_seed(CharCount)?;
                }
                Some(3) => {
                    ctx.field.set("stream");
                    req.stream = map.next_value::<Option<bool>>()?.unwrap_or(false);
                }
                Some(4) => {
                    ctx.field.set("nvext");
                    map.next_value_seed(NvextSeed {
                        ctx,
                        req: &mut req,
                        tokens: &mut nvext_tokens,
                    })?;
                }
                // Either name (chat's newer one wins when both are given, as in vLLM).
                Some(5) => {
                    let limit = map.next_value::<LenientCount>()?.0;
                    req.max_tokens = req.max_tokens.or(limit);
                }
                Some(6) => {
                    let limit = map.next_value::<LenientCount>()?.0;
                    req.max_tokens = limit.or(req.max_tokens);
                }
                // Not read: where it is, so that the filter can remove it.
                Some(7) => {
                    ctx.field.set("priority");
                    let raw = map.next_value::<&'de RawValue>()?;
                    req.client_priority.push(ctx.range_of(raw)?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            ctx.field.set("(body)");
        }
        match nvext_tokens.or(prompt_tokens) {
            Some(Tokens::Ids(ids)) => req.token_ids = Some(ids),
            Some(Tokens::Span(span)) => req.token_span = Some(span),
            None => {}
        }
        Ok(req)
    }
}

enum Prompt {
    Absent,
    Text(usize),
    Tokens(Vec<u32>),
}

struct PromptSeed<'c> {
    ctx: &'c Ctx<'c>,
}

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or an array of token ids")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Prompt, E> {
        Ok(Prompt::Absent)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.chars().count()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        match seq.next_element_seed(FirstPromptElement { ctx: self.ctx })? {
            None => return Ok(Prompt::Tokens(ids)),
            Some(id) => ids.push(id),
        }
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(Prompt::Tokens(ids))
    }
}

/// The first element of a `prompt` array: a token id, or a string / array (a batch).
struct FirstPromptElement<'c> {
    ctx: &'c Ctx<'c>,
}

impl<'de> DeserializeSeed<'de> for FirstPromptElement<'_> {
    type Value = u32;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstPromptElement<'_> {
    type Value = u32;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id (u32)")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u32, E> {
        u32::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u32, E> {
        u32::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }
    fn visit_str<E: de::Error>(self, _v: &str) -> Result<u32, E> {
        self.ctx.batched.set(true);
        Err(E::custom("batched prompt"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _seq: A) -> Result<u32, A::Error> {
        self.ctx.batched.set(true);
        Err(de::Error::custom("batched prompt"))
    }
}

/// Counts the characters of every string inside a value (object keys excluded).
struct CharCount;

impl<'de> DeserializeSeed<'de> for CharCount {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CharCount {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _v: bool) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_i64<E: de::Error>(self, _v: i64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_u64<E: de::Error>(self, _v: u64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_f64<E: de::Error>(self, _v: f64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        Ok(v.chars().count())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while let Some(c) = seq.next_element_seed(CharCount)? {
            n = n.saturating_add(c);
        }
        Ok(n)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while map.next_key::<IgnoredAny>()?.is_some() {
            n = n.saturating_add(map.next_value_seed(CharCount)?);
        }
        Ok(n)
    }
}

/// A count the router only uses as a hint (`max_tokens`): a non-negative integer (saturated
/// to `u32`), anything else read as absent. The engine, not the router, rejects a bad value.
struct LenientCount(Option<u32>);

impl<'de> Deserialize<'de> for LenientCount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LenientCountVisitor)
    }
}

struct LenientCountVisitor;

impl<'de> Visitor<'de> for LenientCountVisitor {
    type Value = LenientCount;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<LenientCount, E> {
        Ok(LenientCount(Some(u32::try_from(v).unwrap_or(u32::MAX))))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<LenientCount, E> {
        Ok(LenientCount(
            u64::try_from(v)
                .ok()
                .map(|v| u32::try_from(v).unwrap_or(u32::MAX)),
        ))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<LenientCount, E> {
        Ok(LenientCount(None))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<LenientCount, E> {
        Ok(LenientCount(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<LenientCount, E> {
        Ok(LenientCount(None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<LenientCount, E> {
        Ok(LenientCount(None))
    }
    fn visit_none<E: de::Error>(self) -> Result<LenientCount, E> {
        Ok(LenientCount(None))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<LenientCount, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<LenientCount, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(LenientCount(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LenientCount, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(LenientCount(None))
    }
}

#[derive(Deserialize)]
struct AgentHints {
    #[serde(default)]
    osl: Option<u32>,
}

struct NvextSeed<'c, 'r> {
    ctx: &'c Ctx<'c>,
    req: &'r mut LlmRequest,
    tokens: &'r mut Option<Tokens>,
}

impl<'de> DeserializeSeed<'de> for NvextSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NvextSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let ctx = self.ctx;
        let req = self.req;
        while let Some(key) = map.next_key_seed(KeySeed(NVEXT_KEYS))? {
            match key {
                Some(0) => {
                    ctx.field.set("nvext.token_data");
                    let tokens = map.next_value::<Option<Vec<u32>>>()?;
                    let mut cut = None;
                    if let Some(prefill) = ctx.prefill {
                        let marker = tokens.as_ref().is_some_and(Vec::is_empty);
                        cut = take_prefilled(&prefill.token_data, marker)?;
                    }
                    *self.tokens = cut.or(tokens.map(Tokens::Ids));
                }
                Some(hint @ 1..=5) if !ctx.opts.read_hints => {
                    ctx.field
                        .set(NVEXT_FIELDS.get(hint).copied().unwrap_or("nvext"));
                    // Skipped unread; `null` means absent, as everywhere.
                    if map.next_value::<Option<IgnoredAny>>()?.is_some() {
                        req.routing_hints = true;
                    }
                }
                Some(1) => {
                    ctx.field.set("nvext.backend_instance_id");
                    req.pin.worker_id = map.next_value()?;
                    req.routing_hints |= req.pin.worker_id.is_some();
                }
                Some(2) => {
                    ctx.field.set("nvext.dp_rank");
                    req.pin.dp_rank = map.next_value()?;
                    req.routing_hints |= req.pin.dp_rank.is_some();
                }
                Some(3) => {
                    ctx.field.set("nvext.allowed_worker_ids");
                    req.allowed_worker_ids = map.next_value_seed(Capped::<WorkerId>::new(ctx))?;
                    req.routing_hints |= req.allowed_worker_ids.is_some();
                }
                Some(4) => {
                    ctx.field.set("nvext.required_taints");
                    req.required_taints = map
                        .next_value_seed(Capped::<String>::new(ctx))?
                        .unwrap_or_default();
                    req.routing_hints |= !req.required_taints.is_empty();
                }
                Some(5) => {
                    ctx.field.set("nvext.preferred_taints");
                    req.preferred_taints = map.next_value_seed(TaintWeights { ctx })?;
                    req.routing_hints |= !req.preferred_taints.is_empty();
                }
                Some(6) => {
                    ctx.field.set("nvext.agent_hints");
                    req.osl_hint_tokens =
                        map.next_value::<Option<AgentHints>>()?.and_then(|h| h.osl);
                }
                Some(7) => {
                    ctx.field.set("nvext.lora_name");
                    req.lora_name = map.next_value()?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            ctx.field.set("nvext");
        }
        Ok(())
    }
}

/// A list of at most `opts.max_hint_items` items (`null` = absent); one more is an error, so a
/// hostile body never makes the filter hold more than the cap.
struct Capped<'c, T> {
    ctx: &'c Ctx<'c>,
    item: std::marker::PhantomData<T>,
}

impl<'c, T> Capped<'c, T> {
    fn new(ctx: &'c Ctx<'c>) -> Self {
        Capped {
            ctx,
            item: std::marker::PhantomData,
        }
    }
}

fn over_cap<E: de::Error>(ctx: &Ctx) -> E {
    ctx.over_cap.set(true);
    E::custom("too many items")
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Capped<'_, T> {
    type Value = Option<Vec<T>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Capped<'_, T> {
    type Value = Option<Vec<T>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let max = self.ctx.opts.max_hint_items;
        let mut out = Vec::new();
        while let Some(item) = seq.next_element::<T>()? {
            if out.len() >= max {
                return Err(over_cap(self.ctx));
            }
            out.push(item);
        }
        Ok(Some(out))
    }
}

/// `{taint: weight}` in body order; `null` = none. At most `opts.max_hint_items` entries.
struct TaintWeights<'c> {
    ctx: &'c Ctx<'c>,
}

impl<'de> DeserializeSeed<'de> for TaintWeights<'_> {
    type Value = Vec<(String, f64)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TaintWeights<'_> {
    type Value = Vec<(String, f64)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object mapping taint names to numeric weights")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let max = self.ctx.opts.max_hint_items;
        let mut out = Vec::new();
        while let Some((k, w)) = map.next_entry::<String, f64>()? {
            if out.len() >= max {
                return Err(over_cap(self.ctx));
            }
            if !w.is_finite() {
                return Err(de::Error::custom(format_args!(
                    "weight of \"{k}\" must be finite"
                )));
            }
            out.push((k, w));
        }
        Ok(out)
    }
}
