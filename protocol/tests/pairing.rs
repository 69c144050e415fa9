//! Properties of the pairing-key rule ([`PairingKey::from_request_id`]) over arbitrary ids.

use kvhandoff_protocol::{PairingKey, RequestId};
use proptest::prelude::*;

/// Ids whose length minus 9 falls inside a multi-byte character once crashed the suffix split.
#[test]
fn multibyte_ids_near_the_suffix_do_not_panic() {
    for id in [
        "ééééééééé",
        "aéééééééé",
        "x-é-aaaaa",
        "ñ-abcdef0",
        "€€€-aaaaaaaa",
    ] {
        let request = RequestId::new(id).unwrap();
        let key = PairingKey::from_request_id(&request);
        assert!(id.starts_with(key.as_str()), "{id}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn the_key_is_a_valid_prefix_of_the_id(id in "[^\\p{Cc}]{1,40}") {
        let request = RequestId::new(id.clone()).unwrap();
        let key = PairingKey::from_request_id(&request);
        prop_assert!(key.validate().is_ok());
        prop_assert!(id.starts_with(key.as_str()));
        let stripped = id.len() - key.as_str().len();
        prop_assert!(stripped == 0 || stripped == 9);
    }

    #[test]
    fn any_random_suffix_pairs(
        base in "[^\\p{Cc}]{1,40}",
        a in "[0-9a-fA-F]{8}",
        b in "[0-9a-fA-F]{8}",
    ) {
        let p = RequestId::new(format!("{base}-{a}")).unwrap();
        let d = RequestId::new(format!("{base}-{b}")).unwrap();
        let key = PairingKey::from_request_id(&p);
        prop_assert_eq!(&key, &PairingKey::from_request_id(&d));
        prop_assert_eq!(key.as_str(), base.as_str());
    }
}
