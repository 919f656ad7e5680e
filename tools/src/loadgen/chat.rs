//! A chat workload that looks like real chat traffic: multi-turn conversations (each turn
//! resends the whole history) that open with one of a few long shared system prompts, sent as
//! text `messages`.
//!
//! Spec: `conversations=C,turns=T,system_prompts=S,system_chars=X,user_chars=U,reply_chars=R,
//! osl=O,(rate=Q|concurrency=N)[,seed=E]`. Requests go turn by turn (every conversation's turn 1,
//! then every turn 2, ...), so with more conversations than clients a turn is sent after the
//! previous one of its conversation has been answered, as a user would.

use serde_json::{json, Value};

use super::{Arrival, RequestSpec, Workload};
use crate::mock::openai::prompt_tokens;
use crate::util::splitmix64;

#[derive(Debug, Clone, PartialEq)]
pub struct ChatSpec {
    pub conversations: usize,
    pub turns: usize,
    pub system_prompts: usize,
    pub system_chars: usize,
    pub user_chars: usize,
    pub reply_chars: usize,
    pub osl: usize,
    pub rate: Option<f64>,
    pub concurrency: Option<usize>,
    pub seed: u64,
}

impl ChatSpec {
    pub fn parse(s: &str) -> Result<ChatSpec, String> {
        let mut spec = ChatSpec {
            conversations: 64,
            turns: 6,
            system_prompts: 4,
            system_chars: 8000,
            user_chars: 600,
            reply_chars: 600,
            osl: 32,
            rate: None,
            concurrency: None,
            seed: 42,
        };
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("chat: expected key=value, got {part:?}"))?;
            let num = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("chat: bad {k}={v}"))
            };
            match k.trim() {
                "conversations" => spec.conversations = num(v)?.max(1),
                "turns" => spec.turns = num(v)?.max(1),
                "system_prompts" => spec.system_prompts = num(v)?.max(1),
                "system_chars" => spec.system_chars = num(v)?,
                "user_chars" => spec.user_chars = num(v)?.max(1),
                "reply_chars" => spec.reply_chars = num(v)?,
                "osl" => spec.osl = num(v)?.max(1),
                "concurrency" => spec.concurrency = Some(num(v)?.max(1)),
                "seed" => spec.seed = num(v)? as u64,
                "rate" => {
                    let r: f64 = v
                        .trim()
                        .parse()
                        .map_err(|_| format!("chat: bad rate={v}"))?;
                    if !(r.is_finite() && r > 0.0) {
                        return Err("chat: rate must be > 0".into());
                    }
                    spec.rate = Some(r);
                }
                other => return Err(format!("chat: unknown key {other:?}")),
            }
        }
        if spec.rate.is_none() && spec.concurrency.is_none() {
            spec.concurrency = Some(8);
        }
        Ok(spec)
    }
}

/// `chars` of deterministic English-looking text for `key`.
fn text(key: u64, chars: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "model", "answer", "cache", "prefix", "request", "token", "worker", "router",
        "latency", "system", "user", "please", "explain", "about", "with",
    ];
    let mut out = String::with_capacity(chars + 16);
    let mut state = key;
    while out.len() < chars {
        state = splitmix64(state);
        out.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
        out.push(if state % 11 == 0 { '.' } else { ' ' });
    }
    out.truncate(chars);
    out
}

pub fn chat(spec: &ChatSpec) -> Workload {
    let mut state = spec.seed;
    let mut next = move || {
        state = splitmix64(state);
        state
    };
    let systems: Vec<String> = (0..spec.system_prompts)
        .map(|i| text(0x5157_0000 ^ i as u64, spec.system_chars))
        .collect();
    let picks: Vec<usize> = (0..spec.conversations)
        .map(|_| (next() % spec.system_prompts as u64) as usize)
        .collect();
    let mut histories: Vec<Vec<Value>> = picks
        .iter()
        .map(|&s| vec![json!({"role": "system", "content": systems[s]})])
        .collect();
    let mut requests = Vec::with_capacity(spec.conversations * spec.turns);
    let mut t = 0.0;
    for turn in 0..spec.turns {
        for (c, history) in histories.iter_mut().enumerate() {
            let key = spec.seed ^ ((c as u64) << 24) ^ ((turn as u64) << 8);
            history.push(json!({"role": "user", "content": text(key ^ 1, spec.user_chars)}));
            let messages = Value::Array(history.clone());
            let tokens = prompt_tokens(&json!({"messages": messages}));
            if let Some(rate) = spec.rate {
                let u = ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                t += -u.ln() / rate * 1000.0;
            }
            requests.push(RequestSpec {
                at_ms: if spec.rate.is_some() { t } else { 0.0 },
                tokens,
                max_tokens: spec.osl,
                messages: Some(messages),
                client: Some(c as u64),
            });
            // The client resends the assistant's answer with the next turn.
            history.push(json!({"role": "assistant", "content": text(key ^ 2, spec.reply_chars)}));
        }
    }
    Workload {
        name: format!(
            "chat:conversations={},turns={},system_prompts={},system_chars={}",
            spec.conversations, spec.turns, spec.system_prompts, spec.system_chars
        ),
        requests,
        arrival: match (spec.rate, spec.concurrency) {
            (Some(_), _) => Arrival::Timed,
            (None, c) => Arrival::Concurrency(c.unwrap_or(8)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_resend_the_history_and_system_prompts_are_shared() {
        let spec = ChatSpec::parse(
            "conversations=5,turns=3,system_prompts=2,system_chars=400,user_chars=40,reply_chars=40,concurrency=2",
        )
        .unwrap();
        let w = chat(&spec);
        assert_eq!(w.requests.len(), 15);
        assert!(w.is_chat());
        assert_eq!(w.arrival, Arrival::Concurrency(2));
        // Turn 2 of conversation 0 extends turn 1's ids (history resent).
        let (t1, t2) = (&w.requests[0], &w.requests[5]);
        assert!(t2.tokens.len() > t1.tokens.len());
        assert_eq!(
            t2.tokens[..t1.tokens.len() - 1],
            t1.tokens[..t1.tokens.len() - 1]
        );
        assert_eq!(t2.messages.as_ref().unwrap().as_array().unwrap().len(), 4);
        let systems: std::collections::HashSet<String> = w.requests[..5]
            .iter()
            .map(|r| r.messages.as_ref().unwrap()[0]["content"].to_string())
            .collect();
        assert!(systems.len() <= 2);
        assert!(ChatSpec::parse("bogus=1").is_err());
    }
}
