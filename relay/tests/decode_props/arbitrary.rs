//! Arbitrary bytes.

use super::*;

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_and_normalize(&bytes);
    }

    #[test]
    fn arbitrary_msgpack_shaped_bytes_never_panic(
        // Batch-like prefixes make the decoder go deeper than fully random bytes do.
        prefix in prop::sample::select(vec![
            vec![0x93u8, 0xcb, 0x41, 0xd9, 0, 0, 0, 0, 0, 0],
            vec![0x92, 0x01],
            vec![0x93, 0x01, 0x91],
            vec![0x93, 0x01, 0x91, 0x8b, 0xa4, b't', b'y', b'p', b'e', 0xab],
            vec![0x93, 0x01, 0x92, 0x96, 0xab],
        ]),
        tail in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut bytes = prefix;
        bytes.extend(tail);
        decode_and_normalize(&bytes);
    }

    #[test]
    fn arbitrary_frames_never_panic(
        frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..24), 0..6),
    ) {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        if let Ok(f) = wire::split_pub(&refs) {
            prop_assert_eq!(refs.len(), 3);
            decode_and_normalize(f.payload);
        }
        match wire::split_replay(&refs) {
            Ok(wire::ReplayReply::Batch(f)) => {
                prop_assert!(refs.len() == 3 || refs.len() == 4);
                prop_assert!(refs[0].is_empty());
                decode_and_normalize(f.payload);
            }
            Ok(wire::ReplayReply::End) => prop_assert!(refs.len() == 3 || refs.len() == 4),
            Err(_) => {}
        }
    }
}
