//! A head with a slow disk that can hold all but one layer, beside two weak devices with
//! room for one layer each (found by the property test `plans_are_whole_fit_vram_and_spare_m4`):
//! dropping the weak devices predicts a faster token but overloads the slow disk, which
//! Halda may do only when no plan avoids it. Here one does.

use scheduler::{schedule, DeviceProfile, DeviceSet, ModelProfile, Options};

#[test]
fn a_slow_disk_is_not_overloaded_to_drop_devices_that_make_room() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/cluster-slow-disk-head.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let devices: Vec<DeviceProfile> = serde_json::from_value(v["devices"].clone()).unwrap();
    let model: ModelProfile = serde_json::from_value(v["model"].clone()).unwrap();
    let s = schedule(&devices, &model, &Options::default()).unwrap();
    for c in &s.prediction.devices {
        assert!(!(c.set == DeviceSet::M4 && c.overloaded), "{} overloads its slow disk: {:?}", c.name, s.plan);
    }
    assert_eq!(s.plan.window_sum() * s.plan.rounds(), model.n_layer);
    assert!(s.members.len() > 1, "the head alone cannot hold the model: {:?}", s.plan);
}
