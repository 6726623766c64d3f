//! `wire::decode` must never panic, abort or overflow the stack, whatever the bytes; what it
//! accepts must survive re-encoding unchanged.

#![no_main]

use libfuzzer_sys::fuzz_target;
use stagehand_schemas::wire;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(event) = wire::decode(bytes) {
        let again = wire::encode(&event).expect("a decoded event encodes");
        assert_eq!(wire::decode(&again).ok(), Some(event));
    }
});
