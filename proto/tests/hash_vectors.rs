//! Exact test vectors: those of `docs/engine-wire-formats.md` (§3, §4.2) and
//! values computed with CPython 3.11 (`pickle`, `hashlib`), cbor2 and python-xxhash for the
//! cases the spec does not list (xxhash, extra keys, large pickles with several frames).

use kv_relay_proto::hash::{
    block_event_hashes, cbor, pickle, sglang, vllm, EngineHashConfig, EngineVersion, ExtraKeyForm, HashError, LoraRef,
    MmFeature, NoneHashSeed, PyInt, PyValue, RequestKeys, VllmHashAlgo, VllmHasher, VllmRequest,
};
use sha2::{Digest, Sha256};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn v(s: &str) -> EngineVersion {
    s.parse().unwrap()
}

/// Tokens 1..=16 then 17..=32: two blocks of 16.
fn two_blocks() -> Vec<u64> {
    (1..=32).collect()
}

fn vllm_hashes(algo: VllmHashAlgo, seed: &str) -> Vec<u64> {
    let h = VllmHasher::new(algo, &NoneHashSeed::Seed(seed.into()), 16, ExtraKeyForm::Tagged).unwrap();
    h.block_event_hashes(&VllmRequest { token_ids: &two_blocks(), ..Default::default() }).unwrap()
}

#[test]
fn spec_sha256_default_seed_vectors() {
    let none = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256);
    assert_eq!(hex(&none), "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198");
    let block0 = vllm::block_digest(VllmHashAlgo::Sha256, &none, &two_blocks()[..16], None);
    assert!(hex(&block0).starts_with("7b255da4") && hex(&block0).ends_with("547f4caf"));
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256, "vllm-none-hash"), vec![1403909460543360175, 1643945449041937783]);
}

#[test]
fn spec_sha256_cbor_default_seed_vectors() {
    let none = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256Cbor);
    assert!(hex(&none).starts_with("9bd96a48") && hex(&none).ends_with("9581eef0"));
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256Cbor, "vllm-none-hash"), vec![8866452693264111234, 807986237951177663]);
}

#[test]
fn spec_pythonhashseed_0_vectors() {
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256, "0")[0], 7536218907325174565);
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256Cbor, "0")[0], 3236607068019569386);
    // Second blocks, from CPython.
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256, "0")[1], 9048537298590080561);
    assert_eq!(vllm_hashes(VllmHashAlgo::Sha256Cbor, "0")[1], 2758186210834249151);
}

#[test]
fn xxhash_vectors_from_python_xxhash() {
    let cases = [
        (
            VllmHashAlgo::Xxhash,
            "vllm-none-hash",
            "d98f72b9c430d985211489af307f0229",
            [13245370832660520926, 7948621584451670255],
        ),
        (VllmHashAlgo::Xxhash, "0", "6fb31cc38bba6066183f7f2104b9c051", [11844795890135418255, 14253768906014549686]),
        (
            VllmHashAlgo::XxhashCbor,
            "vllm-none-hash",
            "a4e364baa0791a6f63bbf917db9b700d",
            [6207774409022517823, 6941834403395884185],
        ),
        (VllmHashAlgo::XxhashCbor, "0", "1ebe36576dcb573f26b99533a20aaeca", [882618318818381833, 12890060145260523405]),
    ];
    for (algo, seed, none_hex, blocks) in cases {
        let none = NoneHashSeed::Seed(seed.into()).none_hash(algo);
        assert_eq!(hex(&none), none_hex, "{algo} {seed}");
        assert_eq!(vllm_hashes(algo, seed), blocks.to_vec(), "{algo} {seed}");
    }
}

#[test]
fn spec_cache_salt_vectors_untagged_and_tagged() {
    let tokens = two_blocks();
    let request = RequestKeys { token_ids: &tokens[..16], cache_salt: Some("tenant-a"), ..Default::default() };
    let untagged = EngineHashConfig::vllm(v("0.30.0"), VllmHashAlgo::Sha256, None, 16).unwrap();
    let tagged = EngineHashConfig::vllm(v("0.31.0"), VllmHashAlgo::Sha256, None, 16).unwrap();
    assert_eq!(block_event_hashes(&untagged, &request).unwrap(), vec![5141184742454457905]);
    assert_eq!(block_event_hashes(&tagged, &request).unwrap(), vec![14725353451287653808]);
}

#[test]
fn cache_salt_enters_block_zero_only_but_changes_the_whole_chain() {
    let tokens = two_blocks();
    let cfg = EngineHashConfig::vllm(v("0.32.0"), VllmHashAlgo::Sha256, Some("0"), 16).unwrap();
    let plain = block_event_hashes(&cfg, &RequestKeys { token_ids: &tokens, ..Default::default() }).unwrap();
    let salted =
        block_event_hashes(&cfg, &RequestKeys { token_ids: &tokens, cache_salt: Some("s"), ..Default::default() })
            .unwrap();
    let empty_salt =
        block_event_hashes(&cfg, &RequestKeys { token_ids: &tokens, cache_salt: Some(""), ..Default::default() })
            .unwrap();
    assert_ne!(plain[0], salted[0]);
    assert_ne!(plain[1], salted[1]);
    assert_eq!(plain, empty_salt, "an empty salt is falsy in vLLM");
}

#[test]
fn spec_seed_pickle_bytes() {
    assert_eq!(
        hex(&pickle::dumps(&PyValue::str("vllm-none-hash"))),
        format!("8005951200000000000000{}{}942e", "8c0e", hex(b"vllm-none-hash"))
    );
}

#[test]
fn spec_cbor_example_bytes() {
    let none = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256Cbor);
    let value = PyValue::Tuple(vec![
        PyValue::bytes(none.clone()),
        PyValue::token_tuple(&[1, 2, 3, 300, 70000, 5]),
        PyValue::None,
    ]);
    assert_eq!(hex(&cbor::dumps(&value)), format!("835820{}8601020319012c1a0001117005f6", hex(&none)));
}

#[test]
fn spec_block_pickle_layout() {
    // 80 05 | 95 <len> | 43 20 <32 B> 94 | 28 <ints> 74 94 | 4e | 87 94 | 2e
    let parent = [7u8; 32];
    let value = PyValue::Tuple(vec![
        PyValue::bytes(parent.to_vec()),
        PyValue::token_tuple(&[1, 300, 70000, 1 << 40]),
        PyValue::None,
    ]);
    let body =
        format!("4320{}9428{}{}{}{}74944e87942e", hex(&parent), "4b01", "4d2c01", "4a70110100", "8a06000000000001");
    let frame_len = hex(&((body.len() / 2) as u64).to_le_bytes());
    let want = format!("800595{frame_len}{body}");
    assert_eq!(hex(&pickle::dumps(&value)), want);
}

/// Extra keys of every form, with LoRA, two multimodal items, salt and prompt embeds.
/// In the tagged form the second `"mm"` literal is the same (interned) object as the first,
/// so CPython writes `BINGET 6` (`68 06`) for it.
#[test]
fn extra_key_forms_match_cpython_pickles() {
    let none = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256);
    let lora = LoraRef { name: "my-lora".into(), path: "/loras/x".into() };
    let embeds: [u8; 32] = Sha256::digest(b"embeds").into();
    let extras = vllm::BlockExtras {
        lora: Some(&lora),
        mm: vec![("abc", -3), ("def", 5)],
        cache_salt: Some("tenant-a"),
        prompt_embeds: Some(&embeds),
    };
    let tokens: Vec<u64> = (1..=16).collect();
    let cases = [
        (ExtraKeyForm::Untagged, "8005959b000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d7119894284b014b024b034b044b054b064b074b084b094b0a4b0b4b0c4b0d4b0e4b0f4b107494288c076d792d6c6f7261948c03616263944afdffffff86948c03646566944b0586948c0874656e616e742d61944320804e6a0a978d599015792e2aed8279eefe7a9ca6b81f572c31da48fe2d2c0fa994749487942e", 651867518218794504u64, 8796605349202583098u64),
        (ExtraKeyForm::Tagged, "800595d7000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d7119894284b014b024b034b044b054b064b074b084b094b0a4b0b4b0c4b0d4b0e4b0f4b107494288c046c6f7261948c076d792d6c6f7261948c082f6c6f7261732f789487948c026d6d948c03616263944afdffffff879468068c03646566944b0587948c0a63616368655f73616c74948c0874656e616e742d619486948c0d70726f6d70745f656d62656473944320804e6a0a978d599015792e2aed8279eefe7a9ca6b81f572c31da48fe2d2c0fa9948694749487942e", 3131090922259226614, 11388649039124618920),
        (ExtraKeyForm::UntaggedBareMm, "80059590000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d7119894284b014b024b034b044b054b064b074b084b094b0a4b0b4b0c4b0d4b0e4b0f4b107494288c076d792d6c6f7261948c03616263948c03646566948c0874656e616e742d61944320804e6a0a978d599015792e2aed8279eefe7a9ca6b81f572c31da48fe2d2c0fa994749487942e", 16035899762494218494, 4537215168480823722),
    ];
    let none_cbor = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256Cbor);
    for (form, pickle_hex, sha_event, cbor_event) in cases {
        let keys = form.extra_keys(&extras);
        let value =
            PyValue::Tuple(vec![PyValue::bytes(none.clone()), PyValue::token_tuple(&tokens), keys.clone().unwrap()]);
        assert_eq!(hex(&pickle::dumps(&value)), pickle_hex, "{form:?}");
        let d = vllm::block_digest(VllmHashAlgo::Sha256, &none, &tokens, keys.as_ref());
        assert_eq!(vllm::event_hash(&d), sha_event, "{form:?}");
        let d = vllm::block_digest(VllmHashAlgo::Sha256Cbor, &none_cbor, &tokens, keys.as_ref());
        assert_eq!(vllm::event_hash(&d), cbor_event, "{form:?}");
    }
}

#[test]
fn no_extras_hash_none_not_an_empty_tuple() {
    assert_eq!(ExtraKeyForm::Tagged.extra_keys(&vllm::BlockExtras::default()), None);
}

#[test]
fn request_api_places_lora_mm_and_salt_keys_per_block() {
    // Block 0 of a LoRA + image request is hashed with the keys the tagged form builds.
    let lora = LoraRef { name: "my-lora".into(), path: "/loras/x".into() };
    let mm = [MmFeature { identifier: "img".into(), offset: 10, length: 10 }];
    let tokens = two_blocks();
    let cfg = VllmHasher::for_release(v("0.32.0"), VllmHashAlgo::Sha256, Some("0"), 16).unwrap();
    let got = cfg
        .block_digests(&VllmRequest {
            token_ids: &tokens,
            lora: Some(&lora),
            mm_features: &mm,
            cache_salt: Some("t"),
            prompt_embeds: &[],
        })
        .unwrap();
    let k0 = ExtraKeyForm::Tagged.extra_keys(&vllm::BlockExtras {
        lora: Some(&lora),
        mm: vec![("img", 10)],
        cache_salt: Some("t"),
        prompt_embeds: None,
    });
    let k1 = ExtraKeyForm::Tagged.extra_keys(&vllm::BlockExtras {
        lora: Some(&lora),
        mm: vec![("img", -6)],
        cache_salt: None,
        prompt_embeds: None,
    });
    let b0 = vllm::block_digest(VllmHashAlgo::Sha256, cfg.none_hash(), &tokens[..16], k0.as_ref());
    let b1 = vllm::block_digest(VllmHashAlgo::Sha256, &b0, &tokens[16..], k1.as_ref());
    assert_eq!(got, vec![b0, b1]);
}

#[test]
fn random_none_hash_must_be_supplied() {
    let err = EngineHashConfig::vllm(v("0.28.0"), VllmHashAlgo::Sha256, None, 16).unwrap_err();
    assert!(matches!(err, HashError::RandomNoneHash { .. }));
    assert_eq!(
        err.to_string(),
        "vllm 0.28.0 seeds the sha256 none hash randomly when PYTHONHASHSEED is unset; \
         supply the engine's none hash explicitly"
    );
    // With the engine's NONE_HASH in hand the chain is reproducible again.
    let none = NoneHashSeed::Seed("vllm-none-hash".into()).none_hash(VllmHashAlgo::Sha256);
    let h = VllmHasher::with_none_hash(VllmHashAlgo::Sha256, none, 16, ExtraKeyForm::Untagged).unwrap();
    let got = h.block_event_hashes(&VllmRequest { token_ids: &two_blocks(), ..Default::default() }).unwrap();
    assert_eq!(got, vec![1403909460543360175, 1643945449041937783]);
}

#[test]
fn only_full_blocks_are_hashed() {
    let cfg = EngineHashConfig::vllm(v("0.32.0"), VllmHashAlgo::Sha256, Some("0"), 16).unwrap();
    let tokens: Vec<u64> = (1..=47).collect();
    let req = RequestKeys { token_ids: &tokens, ..Default::default() };
    assert_eq!(block_event_hashes(&cfg, &req).unwrap().len(), 2);
    assert!(matches!(
        EngineHashConfig::vllm(v("0.32.0"), VllmHashAlgo::Sha256, Some("0"), 0),
        Err(HashError::ZeroBlockSize)
    ));
}

/// `sha256(pickle.dumps(x, protocol=5))` from CPython for pickles of several frames,
/// payloads written outside frames, and ints of every opcode.
#[test]
fn large_pickles_frame_like_cpython() {
    fn ints(v: &[u64]) -> PyValue {
        PyValue::token_tuple(v)
    }
    let range: Vec<u64> = (0..70000).collect();
    let cases: Vec<(&str, PyValue, &str, usize)> = vec![
        (
            "range70000",
            PyValue::Tuple(vec![PyValue::bytes(vec![0; 32]), ints(&range), PyValue::None]),
            "0c70d4027de479f4623a43a20543d4ba5d1bb72b36ebcd13bcc9d4976e74c43c",
            218752,
        ),
        (
            "k21833",
            PyValue::Tuple(vec![PyValue::bytes(vec![b'x'; 32]), ints(&[300; 21833]), PyValue::None]),
            "e74a8a8216389a5736c2fa56ef289dedb11b0a1b2eafa634e1796d38d9a63f4e",
            65561,
        ),
        (
            "k21834",
            PyValue::Tuple(vec![PyValue::bytes(vec![b'x'; 32]), ints(&[300; 21834]), PyValue::None]),
            "8968633ce83e66e2ec9e380fa02bb0e474d22c57087017575e6aabde15d2f0da",
            65564,
        ),
        (
            "k21835",
            PyValue::Tuple(vec![PyValue::bytes(vec![b'x'; 32]), ints(&[300; 21835]), PyValue::None]),
            "f273f3fc964a2a130316580738451e818431b0578dc794953f0044a59eaa8172",
            65567,
        ),
        (
            "nested",
            PyValue::Tuple(vec![
                PyValue::bytes(vec![b'x'; 32]),
                ints(&[300; 21830]),
                PyValue::Tuple(vec![PyValue::str("ab"), PyValue::str("cd")]),
            ]),
            "8ad879d6d2ccb71ab2b4d676eddeae050146e61b4fdc9af9bffb1ac1d00fab43",
            65554,
        ),
        (
            "bigbytes",
            PyValue::Tuple(vec![PyValue::bytes(vec![b'x'; 70000]), ints(&[1, 2]), PyValue::None]),
            "45d765802fc4b432f52d856b476d124d80fcde2651e54ef67d327a3cff930764",
            70027,
        ),
        (
            "bigstr",
            PyValue::Tuple(vec![
                PyValue::bytes(vec![b'x'; 32]),
                ints(&[1, 2]),
                PyValue::str("y".repeat(70000)),
                PyValue::str("z"),
            ]),
            "d48ab31e385e66a15caece18cbcdcb453dc2860a1a7cb162e7763c5a67d068bb",
            70075,
        ),
        (
            "ints",
            PyValue::Tuple(
                [
                    PyValue::int(-(1i64 << 31) - 1),
                    PyValue::int(-(1i64 << 39)),
                    PyValue::int(1u128 << 64),
                    PyValue::int(-1i64),
                    PyValue::int(1i64 << 31),
                    PyValue::int(-(1i64 << 31)),
                    PyValue::Int(PyInt::from_sign_magnitude(false, &pow2_2100())),
                    PyValue::Int(PyInt::from_sign_magnitude(true, &pow2_2100())),
                    PyValue::int(i64::MIN),
                    PyValue::int(1u64 << 63),
                    PyValue::int(0u64),
                    PyValue::int(255u64),
                    PyValue::int(256u64),
                    PyValue::int(65535u64),
                    PyValue::int(65536u64),
                ]
                .to_vec(),
            ),
            "7becec7bc78f2fa86b5cf95a8f9e5a256dfa72143de931a2e5b66b4ff737b62f",
            629,
        ),
    ];
    for (name, value, sha, len) in cases {
        let bytes = pickle::dumps(&value);
        assert_eq!(bytes.len(), len, "{name}");
        assert_eq!(hex(&Sha256::digest(&bytes)), sha, "{name}");
    }
}

fn pow2_2100() -> Vec<u8> {
    let mut m = vec![0u8; 263];
    m[0] = 0x10;
    m
}

/// Past 256 memo entries CPython uses `LONG_BINGET` (`6a`).
#[test]
fn memo_reference_past_index_255_uses_long_binget() {
    let items: Vec<PyValue> = (0..300).map(|i| PyValue::Tuple(vec![PyValue::str(format!("s{i}"))])).collect();
    let value = PyValue::Tuple(vec![PyValue::Tuple(items), PyValue::interned("mm"), PyValue::interned("mm")]);
    assert_eq!(
        hex(&Sha256::digest(pickle::dumps(&value))),
        "eaf643738b4855354a49a38fdfc4a0d7ec77b88e4b97cac083261d94d8f695d4"
    );
}

#[test]
fn cbor_bignums_and_long_strings_match_cbor2() {
    let ints = PyValue::Tuple(vec![
        PyValue::int(1u128 << 70),
        PyValue::int(-(1i128 << 70)),
        PyValue::int(1u128 << 64),
        PyValue::int(-(1i128 << 64) - 1),
        PyValue::int(-(1i128 << 64)),
        PyValue::int(0u64),
        PyValue::int(-1i64),
    ]);
    assert_eq!(
        hex(&cbor::dumps(&ints)),
        "87c249400000000000000000c3493fffffffffffffffffc249010000000000000000c3490100000000000000003bffffffffffffffff0020"
    );
    let mixed =
        PyValue::Tuple(vec![PyValue::str("é".repeat(30)), PyValue::bytes(vec![1u8; 300]), PyValue::Tuple(vec![])]);
    let want = format!("83783c{}59012c{}80", "c3a9".repeat(30), "01".repeat(300));
    assert_eq!(hex(&cbor::dumps(&mixed)), want);
}

#[test]
fn algorithm_names_round_trip() {
    for algo in [VllmHashAlgo::Sha256, VllmHashAlgo::Sha256Cbor, VllmHashAlgo::Xxhash, VllmHashAlgo::XxhashCbor] {
        assert_eq!(algo.name().parse::<VllmHashAlgo>().unwrap(), algo);
    }
    assert_eq!("builtin".parse::<VllmHashAlgo>().unwrap_err().to_string(), "unknown hash algorithm \"builtin\"");
}

// ---- SGLang ----

#[test]
fn spec_sglang_page_vectors() {
    let cfg = EngineHashConfig::sglang(v("0.5.23"), 16, false).unwrap();
    let tokens = two_blocks();
    let req = RequestKeys { token_ids: &tokens, ..Default::default() };
    let got = block_event_hashes(&cfg, &req).unwrap();
    assert_eq!(got, vec![8635429971592222890, 1256577331724852459]);
    // The signed form and its bit pattern.
    let d = sglang::page_digest(None, &tokens[..16]);
    assert_eq!(sglang::digest_to_i64(&d), 8635429971592222890);
}

#[test]
fn spec_sglang_bigram_vector() {
    let pairs: Vec<(u64, u64)> = (1..=16).map(|i| (i, i + 1)).collect();
    let d = sglang::bigram_page_digest(None, &pairs);
    assert_eq!(sglang::digest_to_i64(&d), -7316793502406646264);
    // Through the request API: 17 tokens make 16 bigrams, one page.
    let cfg = EngineHashConfig::sglang(v("0.5.23"), 16, true).unwrap();
    let tokens: Vec<u64> = (1..=17).collect();
    let got = block_event_hashes(&cfg, &RequestKeys { token_ids: &tokens, ..Default::default() }).unwrap();
    assert_eq!(got, vec![(-7316793502406646264i64) as u64]);
}

#[test]
fn sglang_lora_namespacing_matches_the_manifest_formula() {
    // seed = SHA256(b"sglang-kv-event-namespace-v1" || 01 || u64_le(len) || key || 00)
    let key = "0123456789abcdef0123456789abcdef";
    let mut seed_input = b"sglang-kv-event-namespace-v1".to_vec();
    seed_input.push(1);
    seed_input.extend_from_slice(&(key.len() as u64).to_le_bytes());
    seed_input.extend_from_slice(key.as_bytes());
    seed_input.push(0);
    let seed: [u8; 32] = Sha256::digest(&seed_input).into();
    assert_eq!(sglang::namespace_seed(Some(key), None), seed);
    let h = 8635429971592222890i64;
    let mut input = seed.to_vec();
    input.extend_from_slice(&h.to_be_bytes());
    let d: [u8; 32] = Sha256::digest(&input).into();
    assert_eq!(sglang::namespaced_block_hash(h, &seed), sglang::digest_to_i64(&d));
}

#[test]
fn sglang_release_gates() {
    assert!(matches!(EngineHashConfig::sglang(v("0.4.7"), 16, false), Err(HashError::UnsupportedVersion { .. })));
    let old = EngineHashConfig::sglang(v("0.5.9"), 4, false).unwrap();
    let tokens: Vec<u64> = (1..=8).collect();
    let salted = RequestKeys { token_ids: &tokens, cache_salt: Some("t"), ..Default::default() };
    assert!(matches!(block_event_hashes(&old, &salted), Err(HashError::Unsupported(_))));
    let tuple = EngineHashConfig::sglang(v("0.5.5"), 4, false).unwrap();
    let got = block_event_hashes(&tuple, &RequestKeys { token_ids: &tokens, ..Default::default() }).unwrap();
    // CPython: hash((1, 2, 3, 4)), hash((5, 6, 7, 8)).
    assert_eq!(got, vec![590899387183067792, 1180810341090028427]);
}
