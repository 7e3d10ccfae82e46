"""Package metadata comes from settings.ini (the nbdev-2 convention), read with configparser only."""
from configparser import ConfigParser
from pathlib import Path
import setuptools

here = Path(__file__).parent
config = ConfigParser(delimiters=['='])
config.read(here/'settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

expected = 'version description keywords author author_email license lib_name user min_python'.split()
missing = [o for o in expected if o not in cfg]
if missing: raise SystemExit(f"settings.ini is missing: {', '.join(missing)}")

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License'),
            'mit': ('MIT License', 'OSI Approved :: MIT License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()
min_python = cfg['min_python']
lic = licenses.get(cfg['license'].lower(), (cfg['license'], None))

def _reqs(key): return cfg.get(key, '').split()
readme = here/'README.md'

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else '',
    long_description_content_type='text/markdown',
    keywords=cfg['keywords'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=lic[0],
    url=cfg.get('git_url'),
    classifiers=[f"Development Status :: {statuses[int(cfg['status'])]}", f"Intended Audience :: {cfg['audience']}",
                 f"Natural Language :: {cfg['language']}"]
                + ([f'License :: {lic[1]}'] if lic[1] else [])
                + [f'Programming Language :: Python :: {v}' for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=[cfg['lib_path'], f"{cfg['lib_path']}.*"]),
    # `pip install -e .` then puts this checkout's folder on `sys.path` (a .pth line) instead of an import hook: a clone
    # named `fp16cb` in the folder a script runs from is an empty namespace package, which an import hook would let win
    # (`import fp16cb` patching nothing); on `sys.path`, the real package here beats it.
    package_dir={'': '.'},
    include_package_data=True,
    install_requires=_reqs('requirements'),
    extras_require={'dev': _reqs('dev_requirements'), 'bench': _reqs('bench_requirements')},
    python_requires=f'>={min_python}',
    entry_points={'console_scripts': _reqs('console_scripts')},
    zip_safe=False,
)
