//! `decode(encode(m)) == m` for every message variant, over random valid messages.

mod common;

use common::*;
use kvhandoff_protocol::wire::{self, HEADER_LEN};
use kvhandoff_protocol::{Message, PROTOCOL_VERSION};
use proptest::prelude::*;

/// Encodes, checks the header, decodes, and compares.
fn round_trip(message: &Message) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        message.validate(),
        Ok(()),
        "the strategy built an invalid message"
    );
    let bytes = wire::encode(message);
    let header = wire::decode_header(&bytes).unwrap();
    prop_assert_eq!(header.kind, message.kind());
    prop_assert_eq!(header.payload_len, bytes.len() - HEADER_LEN);
    prop_assert_eq!(&bytes[4..6], &PROTOCOL_VERSION.to_le_bytes()[..]);
    let decoded = wire::decode(&bytes);
    prop_assert_eq!(decoded.as_ref(), Ok(message));
    // Encoding is a function of the message: the same message always gives the same bytes.
    prop_assert_eq!(wire::encode(&decoded.unwrap()), bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn handshake_round_trips(m in handshake()) {
        round_trip(&Message::Handshake(Box::new(m)))?;
    }

    #[test]
    fn register_round_trips(m in register()) {
        round_trip(&Message::Register(Box::new(m)))?;
    }

    #[test]
    fn write_done_round_trips(m in write_done()) {
        round_trip(&Message::WriteDone(m))?;
    }

    #[test]
    fn write_failed_round_trips(m in write_failed()) {
        round_trip(&Message::WriteFailed(m))?;
    }

    #[test]
    fn cancel_round_trips(m in cancel()) {
        round_trip(&Message::Cancel(m))?;
    }

    #[test]
    fn cancel_ack_round_trips(m in cancel_ack()) {
        round_trip(&Message::CancelAck(m))?;
    }

    #[test]
    fn heartbeat_round_trips(m in heartbeat()) {
        round_trip(&Message::Heartbeat(m))?;
    }

    #[test]
    fn release_round_trips(m in release()) {
        round_trip(&Message::Release(m))?;
    }

    #[test]
    fn any_message_round_trips(m in message()) {
        round_trip(&m)?;
    }

    /// The geometry strategy only builds valid geometries, and the region table it pairs them with
    /// follows `regions()`.
    #[test]
    fn generated_geometries_are_valid((g, regions) in geometry_and_regions()) {
        prop_assert_eq!(g.validate(), Ok(()));
        let specs = g.regions().unwrap();
        prop_assert_eq!(specs.len(), regions.len());
        for (spec, region) in specs.iter().zip(&regions) {
            prop_assert_eq!(spec.block_len, region.block_len);
            prop_assert_eq!(region.validate(), Ok(()));
        }
    }
}

/// The variant lists the strategies draw from hold every variant once, in declaration order (the
/// exhaustive match in `common::variant_index` fails to compile when a variant is added).
#[test]
fn strategy_variant_lists_are_complete() {
    for (i, v) in WRITE_FAILURES.iter().enumerate() {
        assert_eq!(variant_index(VariantOf::WriteFailure(*v)), i);
    }
    for (i, v) in CANCEL_REASONS.iter().enumerate() {
        assert_eq!(variant_index(VariantOf::CancelReason(*v)), i);
    }
    for (i, v) in RELEASE_REASONS.iter().enumerate() {
        assert_eq!(variant_index(VariantOf::ReleaseReason(*v)), i);
    }
    for (i, v) in TRANSFER_MODES.iter().enumerate() {
        assert_eq!(variant_index(VariantOf::TransferMode(*v)), i);
    }
}

/// Every variant of every enum survives the wire (the strategies pick them at random; this
/// makes sure each one is covered).
#[test]
fn every_enum_variant_round_trips() {
    use kvhandoff_protocol::{Cancel, Epoch, PairingKey, Release, WriteFailed};
    let key = PairingKey::new("k").unwrap();
    let mut messages = Vec::new();
    for reason in WRITE_FAILURES {
        messages.push(Message::WriteFailed(WriteFailed {
            key: key.clone(),
            epoch: Epoch(1),
            prefill_rank: 0,
            reason,
        }));
    }
    for reason in CANCEL_REASONS {
        messages.push(Message::Cancel(Cancel {
            key: key.clone(),
            epoch: Epoch(1),
            reason,
        }));
    }
    for reason in RELEASE_REASONS {
        messages.push(Message::Release(Release {
            key: key.clone(),
            epoch: Epoch(1),
            reason,
        }));
    }
    for m in messages {
        assert_eq!(wire::decode(&wire::encode(&m)), Ok(m));
    }
}
