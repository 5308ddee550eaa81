//! Where a model runs: `cpu` or `cuda[:N]`, as command lines and configs spell it.

use serde::{Deserialize, Serialize};

/// Where a model runs: the CPU path (tlt-kernels) or CUDA device `N` (`tlt_model::cuda`, which needs the `cuda`
/// feature and a driver). Parsed from and written as `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Device {
    /// The CPU.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "cpu" => Ok(Self::Cpu),
            None if s == "cuda" => Ok(Self::Cuda(0)),
            Some(("cuda", n)) => n.parse().map(Self::Cuda).map_err(|_| format!("bad CUDA ordinal in {s:?}")),
            _ => Err(format!("device must be cpu, cuda or cuda:N, got {s:?}")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Device> for String {
    fn from(d: Device) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_and_round_trip() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cpu:0", ""] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
        for d in [Device::Cpu, Device::Cuda(2)] {
            assert_eq!(d.to_string().parse(), Ok(d));
        }
    }
}
