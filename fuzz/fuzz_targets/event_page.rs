//! Worker event pages and dumps: never panics; a parsed page survives the shared-log codec
//! unchanged (decode(encode(x)) == x).
#![no_main]
use envoy_kv_router::events::{
    decode_log_batch, encode_log_batch, parse_dump, parse_event_page, LogRecord,
};
use libfuzzer_sys::fuzz_target;

const MAX_BYTES: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    for (i, parsed) in [
        parse_event_page(data, 64, MAX_BYTES),
        parse_dump(data, 64, MAX_BYTES),
        parse_event_page(data, 4, MAX_BYTES),
    ]
    .into_iter()
    .enumerate()
    {
        let Ok(page) = parsed else { continue };
        let records = vec![
            LogRecord::Events {
                worker: i as u16,
                events: page.events.clone(),
            },
            LogRecord::Resync {
                worker: u16::MAX,
                last_event_id: page.last_event_id,
                events: page.events,
            },
            LogRecord::WorkerLost { worker: 7 },
        ];
        let bytes = encode_log_batch(&records);
        assert_eq!(decode_log_batch(&bytes).as_ref(), Ok(&records));
    }
});
